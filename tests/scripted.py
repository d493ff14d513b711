"""A diffusion engine whose runner commits a chosen token sequence a canvas at a time (the tiny
model's real tokenizer, no model): the inputs of a test are built, not sampled. Used by the unit
tests of logprobs over split characters, streamed tool calls and the parsers."""

from __future__ import annotations

import asyncio
import json

from diffusion_plugin.batcher.batch import RowOutput, StepOutput
from diffusion_plugin.engine import DiffusionEngine
from tandem_core.protocol import DONE
from workers.tiny_models.diffusiongemma import END_OF_TURN


class Adapter:
    """The model adapter's surface the engine reads, over a real tokenizer; EOS is ``<turn|>``."""

    max_position = 10**6
    has_vision = False

    def __init__(self, tok, canvas: int):
        self.tokenizer = tok
        self.canvas_length = canvas
        self.vocab_size = len(tok)
        self.eos_token_ids = (tok.convert_tokens_to_ids(END_OF_TURN),)

    def defaults(self):
        return {"max_denoising_steps": 1, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
                "stability_threshold": 1, "confidence_threshold": 0.005}


class ScriptRunner:
    """Commits ``script`` ``canvas`` tokens a block (one step a block; past its end, its last token
    again), each token with logprob -0.5 - i/100 and a second candidate one lower; records each
    sequence's prompt."""

    def __init__(self, script, canvas: int):
        self.script, self.canvas, self.prompts = script, canvas, []

    def execute(self, batch, seqs):
        rows = []
        for sid in batch.denoise:
            seq = seqs[sid]
            at = len(seq.output_ids)
            if at == 0:
                self.prompts.append(list(seq.prompt_ids))
            block = self.script[at:at + self.canvas]
            block += [self.script[-1]] * (self.canvas - len(block))
            lps = [(-0.5 - (at + j) / 100, [(t, -0.5 - (at + j) / 100), (t + 1, -1.5 - (at + j) / 100)])
                   for j, t in enumerate(block)] if seq.params.logprobs is not None else None
            rows.append(RowOutput(sid, True, committed=block, logprobs=lps))
        return StepOutput(rows=rows)

    def free(self, seq_id):
        pass

    def reset(self):
        pass


def serve(tok, script, calls, canvas: int = 4, engine_args: dict | None = None, runner=None) -> list[list]:
    """Each (route, body) of ``calls`` on an engine whose runner commits ``script``; their items."""
    runner = runner or ScriptRunner(script, canvas)

    async def main():
        engine = DiffusionEngine("m", "unused", {"max_batch": 4, **(engine_args or {})})
        engine.start_with(Adapter(tok, canvas), runner, memory=None)
        try:
            return [[x async for x in getattr(engine, route)(body, f"r{i}")] for i, (route, body) in enumerate(calls)]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def payloads(items) -> list[dict]:
    """The SSE chunks of a streamed answer, parsed (``[DONE]`` left out)."""
    return [json.loads(c[len("data: "):]) for c in items if isinstance(c, str) and c != DONE]
