"""Per-sequence state the scheduler reasons about (no tensors: those live in the runner)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SeqStatus(enum.IntEnum):
    """Ordered: every finished state comes after every live one."""

    WAITING = 0  # queued, not admitted
    NEEDS_ENCODE = 1  # admitted (prefill) or block committed (commit pass) - encoder pass next
    DENOISING = 2  # a block is being denoised
    BLOCK_DONE = 3  # converged this block; waiting for the block boundary (block mode)
    FINISHED_STOPPED = 4  # EOS or a stop string
    FINISHED_LENGTH = 5  # max_tokens
    FINISHED_ABORTED = 6  # cancelled / client gone
    FINISHED_ERROR = 7  # its batch failed

    @property
    def finished(self) -> bool:
        return self >= SeqStatus.FINISHED_STOPPED


FINISH_REASON = {
    SeqStatus.FINISHED_STOPPED: "stop",
    SeqStatus.FINISHED_LENGTH: "length",
    SeqStatus.FINISHED_ABORTED: "abort",
    SeqStatus.FINISHED_ERROR: "error",
}


@dataclass
class SamplingParams:
    """One sequence's knobs (validated by ``diffusion_plugin.params``)."""

    max_tokens: int
    max_denoising_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int
    confidence_threshold: float
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    previews: bool = False
    # None: no logprobs (no extra work); k: each committed token's logprob and the top k
    # (``diffusion_plugin.params`` defines them).
    logprobs: int | None = None


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block: int = 0  # blocks committed so far
    step: int = 0  # denoise steps run in the current block
    admitted_at: float | None = None
    block_started: float = 0.0
    error: str | None = None
    # The request's encoded images (the family's ImageEmbeds; opaque here): used by this
    # sequence's prompt pass only, then dropped.
    images: object | None = None
    # A structured output's compiled grammar (xgrammar's CompiledGrammar; opaque here): the
    # runner keeps a matcher per sequence over it (``diffusion_plugin.grammar``).
    grammar: object | None = None

    @property
    def num_cached(self) -> int:
        """Tokens the sequence's cache holds once its pending encoder pass has run."""
        return len(self.prompt_ids) + len(self.output_ids)
