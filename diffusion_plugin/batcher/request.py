"""Per-sequence state the scheduler reasons about (no tensors: those live in the runner)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


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
    """One sequence's knobs (validated by ``diffusion_plugin.api.params``)."""

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
    # (``diffusion_plugin.api.params`` defines them).
    logprobs: int | None = None
    # vLLM's sampling fields (``diffusion_plugin.step.filters``): off at these values.
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) pairs, added to the logits
    min_tokens: int = 0  # EOS refused at output positions below it
    # The canvas controls (vllm#57250) of the first generated block: seed tokens at its first
    # positions (the rest is noise) and the positions held to them.
    seed_canvas: tuple[int, ...] = ()
    pinned: tuple[int, ...] = ()

    def filtered(self, produced: int) -> bool:
        """Whether ``diffusion_plugin.step.filters`` has work for a block starting ``produced`` tokens in."""
        return (self.top_k > 0 or self.top_p < 1 or self.min_p > 0 or self.allowed_token_ids is not None
                or bool(self.logit_bias) or (self.min_tokens > produced and bool(self.eos_token_ids)))


SCORE_SEED = 0  # a score block's noise positions (after a partial block's tokens) draw from this seed
# A label read's canvas: its first positions only (the read is at the first), in a decoder forward
# of the reads alone; vLLM's DiffusionGemma strategy reads a 16-wide canvas too.
READ_CANVAS = 16


@dataclass(frozen=True)
class BlockPlan:
    """How one block starts and ends (``Sequence.plan``). A generated block: ``steps`` denoise
    steps from noise, or from the seed canvas with pinned positions. A score block (echo,
    ``prompt_logprobs``): one read pass at temperature 1 of prompt tokens pinned on the canvas
    (noise after a partial block's tokens, from ``SCORE_SEED``), committing those ``width`` tokens."""

    steps: int
    seed: tuple[int, ...] = ()
    pinned: tuple[int, ...] = ()
    width: int | None = None  # tokens committed (None: the whole canvas)
    scoring: bool = False
    reads: tuple[int, ...] = ()  # a label read: these tokens' scores at the canvas's first position


class Score(NamedTuple):
    """A prompt token's score (a score block's read): its logprob, its rank in the distribution
    (1: the most probable) and the top (id, logprob) pairs, most probable first."""

    logprob: float
    rank: int
    top: list


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    priority: int = 0  # vLLM's: lower is more urgent (waiting rows are admitted by it, then by arrival)
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block: int = 0  # blocks committed so far
    step: int = 0  # denoise steps run in the current block
    admitted_at: float | None = None
    first_token_at: float | None = None  # when its first output block committed (the loop stamps it)
    trace: dict | None = None  # the W3C context its spans continue (``spans.py``; None: untraced)
    block_started: float = 0.0
    error: str | None = None
    # The request's encoded images (the family's ImageEmbeds; opaque here): used by this
    # sequence's prompt pass only, then dropped.
    images: object | None = None
    # A structured output's compiled grammar (xgrammar's CompiledGrammar; opaque here): the
    # runner keeps a matcher per sequence over it (``diffusion_plugin.step.grammar``).
    grammar: object | None = None
    # Scoring (echo with logprobs, prompt_logprobs): the prompt tokens after ``prompt_ids`` read in
    # score blocks before any generation, with the top ``score_k``; their ``Score``s, in order.
    score_ids: list[int] = field(default_factory=list)
    score_k: int = 0
    scores: list = field(default_factory=list)
    # The prefix cache (fast mode): the request's cache_salt (prompts under different salts
    # share nothing), and the prompt tokens its admission found cached.
    cache_salt: str | None = None
    cached_tokens: int = 0
    # A label read (decisions, ``tandem_core.label_reads``): after the prompt, one read-only block
    # whose canvas is noise; ``scores`` gets the log-softmax of each of these tokens at its first
    # position, then the sequence ends (``max_tokens`` 0: nothing is committed or encoded).
    read_ids: tuple[int, ...] = ()

    def score_blocks(self, canvas: int) -> int:
        """Blocks read before any generation: the score blocks, then a label read's block."""
        return -(-len(self.score_ids) // canvas) + bool(self.read_ids)

    def plan(self, canvas: int) -> BlockPlan:
        """The plan of the block that starts now (after ``block`` committed blocks)."""
        if self.read_ids and self.block == self.score_blocks(canvas) - 1:
            return BlockPlan(steps=1, width=0, scoring=True, reads=self.read_ids)
        if self.block < self.score_blocks(canvas):
            tokens = tuple(self.score_ids[self.block * canvas:(self.block + 1) * canvas])
            return BlockPlan(steps=1, seed=tokens, pinned=tuple(range(len(tokens))), width=len(tokens),
                             scoring=True)
        if self.block == self.score_blocks(canvas) and self.params.seed_canvas:
            return BlockPlan(self.params.max_denoising_steps, self.params.seed_canvas, self.params.pinned)
        return BlockPlan(self.params.max_denoising_steps)

    @property
    def prompt_len(self) -> int:
        """The whole prompt: encoded at once, or its first part then its score blocks."""
        return len(self.prompt_ids) + len(self.score_ids)

    @property
    def num_cached(self) -> int:
        """Tokens the sequence's cache holds once its pending encoder pass has run."""
        return len(self.prompt_ids) + len(self.score_ids) + len(self.output_ids)
