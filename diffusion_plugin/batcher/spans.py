"""A diffusion request's spans (OpenTelemetry, ``tandem_core.tracing``): what no autoregressive
engine has to say, under the replica's span of the request (the context a sequence was
submitted in, ``Sequence.trace``):

- ``diffusion prompt``: admission to the end of the first step (the prompt pass), with the
  prompt's tokens and those the prefix cache had (``gen_ai.usage.cache_read.input_tokens``);
- ``diffusion block``: one per committed block, from its first step to its commit, with a
  ``step`` event per denoise step, ``converged`` (stable and confident before the step limit)
  or not, the grammar's masking time where a constraint applies, and a ``commit`` event with
  the tokens it kept.

Built after the fact from the loop's instants (``time.monotonic()``), when a block commits:
nothing lives across steps but a list of step instants per traced sequence. The loop tells it
(``stepped``, ``committed``, ``finished``); sequences without a trace context cost a dict lookup.
"""

from __future__ import annotations

from collections.abc import Callable

from diffusion_plugin.batcher.request import Sequence
from tandem_core import tracing


class SeqSpans:
    def __init__(self, tracer, grammar_seconds: Callable[[str], float]):
        """``grammar_seconds(seq_id)``: the time the sequence's grammar spent masking so far."""
        self.tracer = tracer
        self.grammar_seconds = grammar_seconds
        self._steps: dict[str, list[float]] = {}  # traced sequence -> its current block's step instants
        self._grammar: dict[str, float] = {}  # -> grammar seconds at its block's start

    def stepped(self, seq: Sequence, now: float) -> None:
        if seq.trace is None:
            return
        steps = self._steps.get(seq.seq_id)
        if steps is None:  # its first step: the prompt pass ended with it
            steps = self._steps[seq.seq_id] = []
            self._grammar[seq.seq_id] = 0.0
            span = self._span("diffusion prompt", seq, seq.admitted_at or now, {
                "gen_ai.usage.input_tokens": seq.prompt_len, "gen_ai.usage.cache_read.input_tokens": seq.cached_tokens})
            span.end(end_time=tracing.epoch_ns(now))
        steps.append(now)

    def committed(self, seq: Sequence, new_ids: list[int], now: float, max_steps: int) -> None:
        steps = self._steps.get(seq.seq_id)
        if seq.trace is None or not steps:
            return
        grammar_s = self.grammar_seconds(seq.seq_id) if seq.grammar is not None else 0.0
        attrs = {"tandem.block.index": seq.block - 1, "tandem.block.steps": len(steps),
                 "tandem.block.converged": len(steps) < max_steps, "tandem.block.tokens": len(new_ids)}
        if seq.grammar is not None:
            attrs["tandem.grammar.mask_s"] = grammar_s - self._grammar[seq.seq_id]
        span = self._span("diffusion block", seq, seq.block_started, attrs)
        for i, t in enumerate(steps, 1):
            span.add_event("step", {"step": i}, timestamp=tracing.epoch_ns(t))
        if len(steps) < max_steps:
            span.add_event("converged", {"steps": len(steps)}, timestamp=tracing.epoch_ns(steps[-1]))
        span.add_event("commit", {"tokens": len(new_ids)}, timestamp=tracing.epoch_ns(now))
        span.end(end_time=tracing.epoch_ns(now))
        steps.clear()
        self._grammar[seq.seq_id] = grammar_s

    def finished(self, seq: Sequence) -> None:
        self._steps.pop(seq.seq_id, None)
        self._grammar.pop(seq.seq_id, None)

    def _span(self, name: str, seq: Sequence, start: float, attrs: dict):
        return self.tracer.start_span(name, context=tracing.parent_of(seq.trace), start_time=tracing.epoch_ns(start),
                                      attributes={"tandem.sequence": seq.seq_id, **attrs})
