"""Fast-mode runs of the tiny DiffusionGemma through the real scheduler and runner, with rows
joining mid-run: shared by the fast-mode and compiled-trunk unit tests."""

from diffusion_plugin.batcher.request import SamplingParams, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.step import attention
from diffusion_plugin.step.runner import Runner

# 90 > window; 300 and 600 span several KV pages (ATTN_BLOCK 256) and their sliding layer drops pages.
PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((25, 40, 90, 17, 14, 60, 300, 600))]
ARRIVALS = {0: [0, 1], 3: [2], 20: [3, 4], 40: [5]}  # step -> prompts arriving then (mid-block joins)
LONG_ARRIVALS = {0: [6, 0], 5: [7], 12: [2]}


def run(adapter, arrivals, sampler="fast", max_batch=4, steps=16, row_boundaries=False, max_tokens=70,
        on_step=None, rowwise=False, compiled=False, trunk=False, cuda_graphs=False, batched=None):
    """Each prompt of ``arrivals`` (step -> prompt indices) joins at its step; returns the output
    ids by sequence, the attention kernel calls and the rows of each denoise step."""
    params = {**adapter.defaults(), "max_denoising_steps": steps}
    sched = Scheduler(max_batch=max_batch, canvas_length=adapter.canvas_length, row_boundaries=row_boundaries)
    runner = Runner(adapter, sampler, kv_budget_bytes=64 << 20, rowwise=rowwise, compiled_vocab=compiled,
                    chunk_rows=3 if compiled else 1, compiled_trunk=trunk, cuda_graphs=cuda_graphs,
                    batched_vocab=batched)  # (compiled: chunks of 3 rows and of 1)
    seqs, calls, widths, step = {}, [], [], 0
    while step <= max(arrivals) or sched.has_work():
        for i in arrivals.get(step, []):
            seq = Sequence(seq_id=f"s{i}", prompt_ids=PROMPTS[i], params=SamplingParams(
                max_tokens=max_tokens, seed=10 + i, eos_token_ids=(), **params))
            seqs[seq.seq_id] = seq
            sched.add(seq)
        step += 1
        batch, _ = sched.schedule()
        if batch.empty():
            continue
        before = attention.KERNEL_CALLS[0]
        if on_step is not None:
            on_step(runner, batch, "before")
        sched.update(runner.execute(batch, seqs))
        if on_step is not None:
            on_step(runner, batch, "after")
        if batch.denoise:
            calls.append(attention.KERNEL_CALLS[0] - before)
            widths.append(len(batch.denoise))
    return {s: q.output_ids for s, q in seqs.items()}, calls, widths
