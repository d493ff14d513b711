"""Entropy-bound acceptance: which positions of each row's canvas keep their draw this step, and
whether the row is confident (HF's expressions, all rows at once: sorts and cumsums are per row).

Both samplers call it (``Runner._decide``); exact mode eagerly (HF's bits), fast mode on a device
as one compiled graph (``FastPasses.accept``), one of the few a step launches besides the trunk
and the vocabulary pass."""

from __future__ import annotations

import torch


def accept(entropy: torch.Tensor, bounds: torch.Tensor, thresholds: torch.Tensor, sampled: torch.Tensor,
           renoise: torch.Tensor, canvas: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (R, C) entropy, draws, noise, canvas and argmax canvas, its entropy bound (R, 1) and
    confidence threshold (R,) -> (the next canvas (R, C), the decisions (R, C + 1): the argmax
    canvas and a last column of 1 where the row is confident), the latter for ONE host transfer."""
    sorted_entropy, sorted_idx = torch.sort(entropy, dim=-1, descending=False)
    selection = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= bounds
    accepted = torch.scatter(input=torch.zeros_like(selection), dim=-1, index=sorted_idx, src=selection)
    new_canvas = torch.where(~accepted, renoise, torch.where(accepted, sampled, canvas))
    # Compared as HF does: a float32 mean against the threshold as a float32 scalar.
    confident = entropy.mean(-1) < thresholds
    return new_canvas, torch.cat([argmax, confident[:, None].to(argmax.dtype)], dim=1)
