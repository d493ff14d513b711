"""vLLM's sampling fields on a diffusion canvas, per row, in both samplers.

``apply`` sets to -inf, in place, every token a row's fields refuse in its temperature-scaled
logits (C, V), in vLLM's order: ``logit_bias`` (added to the logits before the temperature, as
vLLM adds it: bias / t here), ``allowed_token_ids`` and ``min_tokens`` (vLLM's logits
processors), then ``min_p``, ``top_k``, ``top_p`` (vLLM's sampler). Everything the step derives
from the logits then follows the filtered distribution: the sampled canvas, the argmax canvas
(never removed by min_p/top_k/top_p), the entropy that drives acceptance, the self-conditioning
soft embedding and the logprobs.

- ``min_tokens``: the model's EOS ids are refused at the block's positions whose output index is
  below ``min_tokens`` (a per-position rule: the first allowed EOS is output token
  ``min_tokens``, as on vLLM).
- ``top_p``: the smallest set of most probable tokens whose mass reaches ``top_p`` (vLLM's rule:
  a token goes when the mass strictly above it already reaches ``top_p``; at least one stays).
  Found among the top ``TOP_P_CANDIDATES`` of each position (one ``topk``, not a sort over the
  vocabulary: a full sort of a 256 x 262,144 canvas costs ~6.6 CPU s); a position whose
  candidates hold less than ``top_p`` (a flat distribution) falls back to sorting that position.

Two forms of the same rules: ``apply`` (exact mode, HF's shapes: -inf in the logits) and, in fast
mode's fused step, ``prepare`` (before the row's max: what can move the argmax, as -inf) then
``cut`` (after the shift and the exponent: each refused token's exponent zeroed, the threshold
fields as one threshold per position, so a threshold field costs one pass over the canvas x
vocabulary, not three). A test checks that the two keep the same tokens.

HF's ``generate()`` has none of these knobs (its only logits processor is the temperature
schedule; a caller's ``logits_processor`` list runs before it). The mask-shaped ones
(``top_k``, ``allowed_token_ids``) commute with the temperature, so exact mode with them equals
``generate()`` given the same mask as a ``logits_processor`` (tested); ``top_p`` and ``min_p``
depend on the temperature and are applied after it, as vLLM applies them.
"""

from __future__ import annotations

import math

import torch

from diffusion_plugin.batcher.request import SamplingParams

TOP_P_CANDIDATES = 1024
_NEG = float("-inf")


def apply(x: torch.Tensor, p: SamplingParams, produced: int, temperature: float = 1.0) -> None:
    """``x``: one row's (C, V) logits divided by ``temperature``, for a block that starts
    ``produced`` output tokens in."""
    V = x.shape[1]
    prepare(x, p, produced, temperature)  # logit_bias, allowed_token_ids, min_tokens
    if p.min_p > 0:  # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p)
        top = x.max(dim=-1, keepdim=True).values
        x.masked_fill_(x < top + math.log(p.min_p), _NEG)
    if 0 < p.top_k < V:
        kth = torch.topk(x, p.top_k, dim=-1).values[:, -1:]
        x.masked_fill_(x < kth, _NEG)
    if p.top_p < 1:
        _top_p(x, p.top_p)


def prepare(x: torch.Tensor, p: SamplingParams, produced: int, temperature: float = 1.0) -> None:
    """Fast mode, on one row's (C, V) temperature-scaled logits before its max: ``logit_bias``
    added, ``allowed_token_ids`` and ``min_tokens`` refused (-inf); ``cut`` does the rest."""
    C, V = x.shape
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=x.device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=x.dtype, device=x.device) / temperature
        x.index_add_(1, ids, bias.expand(C, -1).contiguous())
    if p.allowed_token_ids is not None:
        x.masked_fill_(~_allowed(p.allowed_token_ids, V, x.device), _NEG)
    if p.min_tokens > produced and p.eos_token_ids:
        x[:min(C, p.min_tokens - produced)].index_fill_(1, _eos(p, V, x.device), _NEG)


def cut(x: torch.Tensor, e: torch.Tensor, p: SamplingParams, produced: int) -> None:
    """Fast mode, after ``prepare``: ``x`` the row's logits shifted by their max (clamped below),
    ``e`` their exponents. Zeroes ``e`` wherever a field refuses a token."""
    C, V = x.shape
    if p.allowed_token_ids is not None:
        e.mul_(_allowed(p.allowed_token_ids, V, x.device).to(e.dtype))
    if p.min_tokens > produced and p.eos_token_ids:
        e[:min(C, p.min_tokens - produced)].index_fill_(1, _eos(p, V, x.device), 0.0)
    threshold = None
    if p.min_p > 0:  # the max is 0 here: p_i < min_p * p_max  <=>  x_i < log(min_p)
        threshold = torch.full((C, 1), math.log(p.min_p), dtype=x.dtype, device=x.device)
    if 0 < p.top_k < V:
        kth = torch.topk(x, p.top_k, dim=-1).values[:, -1:]
        threshold = kth if threshold is None else torch.maximum(threshold, kth)
    if threshold is not None:
        e.masked_fill_(x < threshold, 0.0)
    if p.top_p < 1:
        e.masked_fill_(x < _top_p_threshold(x, e, p.top_p), 0.0)


def _top_p_threshold(x: torch.Tensor, e: torch.Tensor, top_p: float) -> torch.Tensor:
    """(C, 1): the least logit kept by top_p, from the masses ``e`` (what earlier fields left)."""
    C, V = x.shape
    total = e.sum(dim=-1, keepdim=True)
    k = min(V, TOP_P_CANDIDATES)
    values, ids = torch.topk(x, k, dim=-1)
    probs = e.gather(-1, ids) / total
    above = torch.cumsum(probs, dim=-1) - probs
    kept = (above < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = values.gather(-1, kept - 1)
    covered = (probs.sum(dim=-1) >= top_p) | (kept[:, 0] < k)
    for j in torch.nonzero(~covered).flatten().tolist():  # a flat position: sorted whole
        v, order = torch.sort(x[j], descending=True)
        q = e[j, order] / total[j]
        n = int(((torch.cumsum(q, dim=-1) - q) < top_p).sum().clamp(min=1))
        threshold[j, 0] = v[n - 1]
    return threshold


def _eos(p: SamplingParams, V: int, device) -> torch.Tensor:
    return torch.tensor([t for t in p.eos_token_ids if t < V], dtype=torch.long, device=device)


def _allowed(ids: tuple[int, ...], V: int, device) -> torch.Tensor:
    keep = torch.zeros(V, dtype=torch.bool, device=device)
    keep[torch.tensor([t for t in ids if t < V], dtype=torch.long, device=device)] = True
    return keep


def _top_p(x: torch.Tensor, top_p: float) -> None:
    C, V = x.shape
    log_total = torch.logsumexp(x, dim=-1, keepdim=True)
    k = min(V, TOP_P_CANDIDATES)
    values = torch.topk(x, k, dim=-1).values  # descending
    probs = torch.exp(values - log_total)
    above = torch.cumsum(probs, dim=-1) - probs  # the mass strictly above each candidate
    kept = (above < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = values.gather(-1, kept - 1)
    covered = (probs.sum(dim=-1) >= top_p) | (kept[:, 0] < k)
    threshold = torch.where(covered[:, None], threshold, torch.full_like(threshold, _NEG))
    x.masked_fill_(x < threshold, _NEG)  # a position not covered keeps all here: sorted below
    for j in torch.nonzero(~covered).flatten().tolist():
        _top_p_sorted(x[j], top_p)


def _top_p_sorted(row: torch.Tensor, top_p: float) -> None:
    """One position by a full sort (its candidates held less than ``top_p``)."""
    values, order = torch.sort(row, descending=True)
    probs = torch.softmax(values, dim=-1)
    above = torch.cumsum(probs, dim=-1) - probs
    drop = above >= top_p
    drop[0] = False
    row[order[drop]] = _NEG
