"""Fast mode's random draws: pure functions of a row's own (seed, step counter, position, stream),
so a row draws the same batched or alone, on any device (no generator state). Family-neutral:
the runner's canvases and a family's vocabulary pass both draw from them."""

from __future__ import annotations

import torch

# The streams a row draws from (GRAMMAR: a constrained row's redraws, ``grammar``).
INIT, SAMPLE, RENOISE, GRAMMAR = 1, 2, 3, 4


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiplication): a counter -> 64 random bits."""
    x = x ^ (x >> 30) & 0x3FFFFFFFF
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64
    x = x ^ (x >> 27) & 0x1FFFFFFFFF
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ (x >> 31) & 0x1FFFFFFFF


def hash_draws(seeds: torch.Tensor, counters: torch.Tensor, length: int, stream: int) -> torch.Tensor:
    """(R,) seeds and step counters -> (R, length) int64 in [0, 2**31): a pure function of each
    row's own (seed, counter, position, stream), so a row draws the same batched or alone."""
    pos = torch.arange(length, dtype=torch.int64, device=seeds.device)
    key = _mix(seeds[:, None] * 1_000_003 + stream) ^ _mix(counters[:, None] * 4_099 + pos[None, :] * 65_537 + stream)
    return (_mix(key) >> 33) & 0x7FFFFFFF


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor, length: int, stream: int) -> torch.Tensor:
    return (hash_draws(seeds, counters, length, stream).to(torch.float64) + 0.5) / 2**31


def step_draws(seeds: torch.Tensor, counters: torch.Tensor, length: int,
               vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fast step's draws for its rows: one uniform per position (SAMPLE, the vocabulary pass's
    inverse CDF) and the renoise ids (RENOISE, positions not accepted)."""
    return hash_uniform(seeds, counters, length, SAMPLE), hash_draws(seeds, counters, length, RENOISE) % vocab
