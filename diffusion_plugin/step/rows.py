"""A sequence's state in the runner (``Row``): its cache, canvas, soft embedding, stability
history and the current block's plan, from admission until it leaves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_plugin.batcher.batch import Pins
from diffusion_plugin.batcher.request import BlockPlan, SamplingParams, Sequence


@dataclass
class Row:
    seq: Sequence
    cache: object
    generator: torch.Generator
    pending: torch.Tensor  # tokens to encode before the next block (prompt, then the last block)
    cur_len: int = 0  # tokens in the cache
    canvas: torch.Tensor | None = None
    soft: torch.Tensor | None = None  # (1, C, H) self-conditioning soft embedding; None on a first step
    history: list[list[int]] | None = None  # the last argmax canvases (stability rule)
    argmax: torch.Tensor | None = None
    version: int = 0  # bumped when the cache changes
    images: object | None = None  # this sequence's own image features, until its prompt pass
    grammar: object | None = None  # a constrained sequence's ``grammar.RowGrammar``
    keys: list | None = None  # prefix cache: the prompt's page keys (None: not cached)
    prefill: bool = True  # the prompt pass is still to run
    plan: BlockPlan | None = None  # the current block's (``Sequence.plan``)
    bp: SamplingParams | None = None  # the knobs of the current block (a score block's: a plain read)
    pins: Pins | None = None  # the current block's pinned positions

    @property
    def constrained(self):
        """The grammar, in a generated block (score blocks read prompt tokens: no grammar)."""
        return None if self.plan is not None and self.plan.scoring else self.grammar

    def stable(self, tokens: list[int], threshold: int) -> bool:
        """The stable half of StableAndConfidentStoppingCriteria: this argmax canvas equals each
        of the last ``threshold`` ones (none yet counts as different)."""
        if threshold == 0:
            return True
        history = self.history or []
        stable = len(history) == threshold and all(h == tokens for h in history)
        self.history = (history + [tokens])[-threshold:]
        return stable


def by_length(rows: list[Row]) -> list[list[Row]]:
    """``rows`` grouped by the length of what they have to encode (an unpadded batch each)."""
    groups: dict[int, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.pending.shape[1], []).append(r)
    return list(groups.values())
