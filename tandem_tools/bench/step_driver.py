"""Real sequences driven by the real scheduler and runner to denoise-only steps: the setup the
step benchmarks share (``bench_vocab``: CPU per step; ``opcount``: aten ops per step)."""

from __future__ import annotations


class Steps:
    """``rows`` sequences of prompts ``prompt_len + grow * i`` tokens long, admitted together; ``full()``
    returns the next step in which every row denoises and none encodes (not yet run); ``run``
    executes a step and applies it."""

    def __init__(self, adapter, rows: int, sampler: str = "fast", compiled: bool = False, prompt_len: int = 16,
                 grow: int = 0, max_tokens: int | None = None, compiled_trunk: bool = False, chunk_rows: int = 1,
                 batched_vocab: bool | None = None):
        from diffusion_plugin.batcher.request import SamplingParams, Sequence
        from diffusion_plugin.batcher.scheduler import Scheduler
        from diffusion_plugin.step.runner import Runner

        self.rows = rows
        self.sched = Scheduler(max_batch=rows, canvas_length=adapter.canvas_length)
        self.runner = Runner(adapter, sampler, chunk_rows=chunk_rows, kv_budget_bytes=1 << 30,
                             compiled_vocab=compiled, compiled_trunk=compiled_trunk, batched_vocab=batched_vocab)
        self.runner.warm()
        params = {**adapter.defaults(), "max_denoising_steps": 64}
        self.seqs = {}
        for i in range(rows):
            seq = Sequence(seq_id=f"s{i}", prompt_ids=[(7 * i + j) % 1000 + 3 for j in range(prompt_len + grow * i)],
                           params=SamplingParams(max_tokens=max_tokens or adapter.canvas_length, seed=i,
                                                 eos_token_ids=(), **params))
            self.seqs[seq.seq_id] = seq
            self.sched.add(seq)

    def full(self, limit: int = 64):
        for _ in range(limit):
            batch, _ = self.sched.schedule()
            if batch.denoise and not batch.encode and len(batch.denoise) == self.rows:
                return batch
            self.run(batch)
        raise RuntimeError(f"bug: {self.rows} rows never denoised together")

    def run(self, batch) -> None:
        self.sched.update(self.runner.execute(batch, self.seqs))
