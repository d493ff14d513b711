"""Images in diffusion batches, on the real batcher (scheduler + runner + DiffusionGemma adapter
with its vision tower) against HF generate():

- image requests with different images, a request with two images and text-only requests join
  at different steps and share batched encoder passes and decoder forwards; each gives exactly
  the tokens HF's generate() gives for it alone, with the same seed and the same pixel values;
- isolation: two requests with the same text and seed but different images answer differently,
  and swapping the images swaps the answers.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_plugin.batcher.request import SamplingParams, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step.runner import Runner
from workers import tiny_models

MAX_TOKENS = 40  # 2 blocks of 32, truncated
ARRIVALS = {0: ["a", "text0"], 3: ["b"], 15: ["two", "text1"]}  # step -> requests arriving then


def _picture(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


PICTURES = {"red": _picture(1, (40, 64)), "noise": _picture(2, (96, 32)), "wide": _picture(3, (24, 120))}


def _chat(text: str, pictures: list[str]) -> list[dict]:
    content = [{"type": "text", "text": text}] + [{"type": "image"} for _ in pictures]
    return [{"role": "user", "content": content}]


REQUESTS = {  # name -> (text, pictures, seed)
    "a": ("What is in this picture?", ["red"], 5),
    "b": ("What is in this picture?", ["noise"], 5),  # same text and seed as "a": only the image differs
    "two": ("Compare these two pictures, please, in detail.", ["wide", "red"], 9),
    "text0": ("Tell me about the river and the sea.", [], 11),
    "text1": ("Hello there", [], 12),
}


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)  # as in a Ray actor
    a = DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))
    assert a.has_vision and a.vision_blocks
    return a


def _inputs(adapter, name: str, swap: dict | None = None):
    text, pictures, seed = REQUESTS[name]
    pictures = [(swap or {}).get(p, p) for p in pictures]
    ids = adapter.tokenizer.apply_chat_template(_chat(text, pictures), add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    images = adapter.encode_images([PICTURES[p] for p in pictures]) if pictures else None
    if images is not None:
        ids = adapter.expand_image_tokens(ids, images.num_soft_tokens)
    return ids, images, seed


def _run_batcher(adapter, knobs, swap=None) -> tuple[dict, dict]:
    params = {**adapter.defaults(), **knobs}
    sched, runner = Scheduler(max_batch=4, canvas_length=adapter.canvas_length), Runner(adapter)
    seqs, stats = {}, {"widest": 0, "mixed_encodes": 0, "image_with_others": 0}
    step = 0
    while step <= max(ARRIVALS) or sched.has_work():
        for name in ARRIVALS.get(step, []):
            ids, images, seed = _inputs(adapter, name, swap)
            seqs[name] = Sequence(seq_id=name, prompt_ids=ids, images=images, params=SamplingParams(
                max_tokens=MAX_TOKENS, seed=seed, eos_token_ids=adapter.eos_token_ids, **params))
            sched.add(seqs[name])
        batch, _ = sched.schedule()
        stats["widest"] = max(stats["widest"], len(batch.denoise))
        if len(batch.encode) > 1:
            stats["mixed_encodes"] += 1
            if any(seqs[s].images is not None for s in batch.encode):
                stats["image_with_others"] += 1  # an image prefill shares an encoder pass
        if not batch.empty():
            sched.update(runner.execute(batch, seqs))
        step += 1
    assert all(s.images is None for s in seqs.values()), "image features must be freed after the prompt pass"
    return {name: s.output_ids for name, s in seqs.items()}, stats


def _reference(adapter, name, knobs) -> list[int]:
    from transformers import DiffusionGemmaForBlockDiffusion

    ids, images, seed = _inputs(adapter, name)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(adapter.tokenizer.name_or_path, dtype=torch.float32).eval()
    extra = {}
    if images is not None:  # what the processor hands generate(): pixels, patch positions, token types
        input_ids = torch.tensor([ids])
        extra = {"pixel_values": images.pixel_values, "image_position_ids": images.image_position_ids,
                 "mm_token_type_ids": (input_ids == adapter.image_token_id).long()}
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, **extra, **knobs).sequences[0, len(ids):]
    out = out.tolist()
    cut = next((i for i, t in enumerate(out) if t in adapter.eos_token_ids), None)
    return (out[:cut] if cut is not None else out)[:MAX_TOKENS]


@pytest.mark.parametrize("knobs", [{"t_min": 0.01, "t_max": 0.02}, {}], ids=["near-greedy", "default"])
def test_image_and_text_requests_in_shared_batches_equal_hf_generate_alone(adapter, knobs):
    outputs, stats = _run_batcher(adapter, knobs)
    assert stats["widest"] >= 3 and stats["image_with_others"] >= 1, stats
    for name in REQUESTS:
        assert outputs[name] == _reference(adapter, name, knobs), f"{name} differs from HF generate()"
    assert outputs["a"] != outputs["b"], "the image must matter"


def test_swapping_the_images_swaps_the_answers(adapter):
    knobs = {"t_min": 0.01, "t_max": 0.02}
    outputs, _ = _run_batcher(adapter, knobs)
    swapped, _ = _run_batcher(adapter, knobs, swap={"red": "noise", "noise": "red"})
    assert outputs["a"] != outputs["b"]
    assert (swapped["a"], swapped["b"]) == (outputs["b"], outputs["a"])
    assert swapped["text0"] == outputs["text0"] and swapped["text1"] == outputs["text1"]  # text rows unaffected
