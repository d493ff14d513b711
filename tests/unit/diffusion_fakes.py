"""Factories for the diffusion batcher's unit tests (no torch): sequences with small canvases,
and a fake denoiser that drives a ``Scheduler`` through hand-built step outputs."""

from diffusion_plugin.batcher.batch import RowOutput, StepOutput
from diffusion_plugin.batcher.request import SamplingParams, Sequence

C = 4
EOS = 99


def make_seq(name, max_tokens=8, steps=3):
    p = SamplingParams(max_tokens=max_tokens, max_denoising_steps=steps, entropy_bound=0.1, t_min=0.4, t_max=0.8,
                       stability_threshold=1, confidence_threshold=0.005, seed=0, eos_token_ids=(EOS,))
    return Sequence(seq_id=name, prompt_ids=[1, 2, 3], params=p)


class FakeDenoiser:
    """Converges row r after ``converge[r]`` steps of each block (else at the step limit)."""

    def __init__(self, sched, converge=None, blocks=None, fail_at=None):
        self.sched, self.converge, self.blocks = sched, converge or {}, blocks or {}
        self.forwarded: list[list[str]] = []
        self.encoded: list[list[str]] = []
        self.fail_at = fail_at

    def step(self):
        batch, finished = self.sched.schedule()
        self.encoded.append(list(batch.encode))
        self.forwarded.append(list(batch.denoise))
        if self.fail_at is not None and len(self.forwarded) == self.fail_at:
            return batch, self.sched.fail(list(self.sched.running), "boom")
        rows = []
        for sid in batch.denoise:
            seq = self.sched.running[sid]
            done = seq.step + 1 >= min(self.converge.get(sid, 99), seq.params.max_denoising_steps)
            block = self.blocks.get(sid, [7] * C)
            rows.append(RowOutput(sid, done, committed=list(block) if done else None))
        _, fin = self.sched.update(StepOutput(rows=rows))
        return batch, finished + fin
