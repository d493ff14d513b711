"""The typed contract between the scheduler (what to run) and the runner (how to run it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class StepBatch:
    """One iteration of the loop: encoder passes first, then one batched decoder forward."""

    admit: list[str] = field(default_factory=list)  # sequences whose state the runner must create
    encode: list[str] = field(default_factory=list)  # prefill (new) or commit (next block) passes
    denoise: list[str] = field(default_factory=list)  # rows of the batched decoder forward
    free: list[str] = field(default_factory=list)  # sequences whose state the runner must drop

    def empty(self) -> bool:
        return not (self.encode or self.denoise)


@dataclass
class RowOutput:
    seq_id: str
    block_done: bool  # stable-and-confident, or the last step of the block
    committed: list[int] | None = None  # the block's tokens (argmax canvas) when block_done
    preview: list[int] | None = None  # argmax canvas after this step, if the sequence wants previews
    # With block_done, for a sequence that asked for logprobs: per position of the block, the
    # committed token's logprob and the top k (token id, logprob) pairs, most probable first.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # A score block's read (``request.BlockPlan.scoring``): a ``request.Score`` per position.
    scores: list | None = None


@dataclass
class StepOutput:
    rows: list[RowOutput] = field(default_factory=list)
    forward_s: float = 0.0  # time inside model forwards (encoder + decoder)
    cached: dict[str, int] = field(default_factory=dict)  # admitted sequences' prompt tokens found cached
    step_s: float = 0.0  # the whole execute() call


class Pins(NamedTuple):
    """A row's pinned canvas positions and their tokens (``request.BlockPlan``); ``k``: the top
    logprobs its ``Score``s carry."""

    positions: list[int]
    tokens: list[int]
    k: int
