"""The real batcher (scheduler + runner + DiffusionGemma adapter) against HF generate().

Six prompts of different lengths join at different steps (so at different blocks of the
others) and share batched decoder forwards and batched encoder passes (prefills and commits); each must give exactly the tokens HF's generate() gives
for that prompt alone after seeding the same way, up to max_tokens or EOS.
"""

import pytest
import torch

from diffusion_plugin.batcher.request import SamplingParams, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step.runner import Runner
from workers import tiny_models

TEXTS = [
    "Hello there",
    "Tell me about the river and the sea, and the fishermen who mend their nets on the quay.",
    "def add(a, b):",
    "Question: What is the capital of France? Answer:" * 3,
    "A",
    "Numbers and dates appear everywhere: 1, 2, 3, 10, 42, 100, 256 " * 4,  # longer than the sliding window
]
ARRIVALS = {0: [0, 1], 3: [2], 20: [3, 4], 40: [5]}  # step -> prompts arriving then
MAX_TOKENS = 70  # 3 blocks of 32, truncated


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)  # as in a Ray actor (OMP_NUM_THREADS=1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


def _reference(adapter, prompt, seed, knobs):
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(adapter.tokenizer.name_or_path, dtype=torch.float32)
    torch.manual_seed(seed)
    out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, **knobs).sequences[0, len(prompt):]
    out = out.tolist()
    cut = next((i for i, t in enumerate(out) if t in adapter.eos_token_ids), None)
    return (out[:cut] if cut is not None else out)[:MAX_TOKENS]


@pytest.mark.parametrize("knobs", [{"t_min": 0.01, "t_max": 0.02}, {}], ids=["near-greedy", "default"])
def test_batched_equals_hf_generate_alone(adapter, knobs):
    prompts = [adapter.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    params = {**adapter.defaults(), **knobs}
    sched, runner = Scheduler(max_batch=4, canvas_length=adapter.canvas_length), Runner(adapter)
    seqs, widest, joined_mid_run, mixed_encodes = {}, 0, set(), 0
    step = 0
    while step <= max(ARRIVALS) or sched.has_work():
        for i in ARRIVALS.get(step, []):
            seq = Sequence(seq_id=f"s{i}", prompt_ids=prompts[i], params=SamplingParams(
                max_tokens=MAX_TOKENS, seed=100 + i, eos_token_ids=adapter.eos_token_ids, **params))
            seqs[seq.seq_id] = seq
            sched.add(seq)
        batch, _ = sched.schedule()
        if batch.admit and any(s.block > 0 for s in sched.running.values()):
            joined_mid_run.update(batch.admit)
        widest = max(widest, len(batch.denoise))
        if len({seqs[s].num_cached for s in batch.encode}) > 1:
            mixed_encodes += 1  # one batched encoder pass over rows of different lengths
        if not batch.empty():
            sched.update(runner.execute(batch, seqs))
        step += 1
    assert widest >= 3, "the sequences must share batched forwards"
    assert joined_mid_run, "some sequences must join while others are past their first block"
    assert mixed_encodes >= 2, "prefills/commits of different lengths must share encoder passes"
    for i, prompt in enumerate(prompts):
        want = _reference(adapter, prompt, 100 + i, knobs)
        assert seqs[f"s{i}"].output_ids == want, f"prompt {i} ({len(prompt)} tokens) differs from HF generate()"
