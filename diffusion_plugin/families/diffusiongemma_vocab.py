"""The vocab-wide part of a DiffusionGemma denoise step, over a few rows at a time.

At the released shape one canvas x vocab float32 tensor is 256 MiB; HF's step makes ~10 of them
per row (logits, softcap, processed logits, softmax, multinomial noise, entropy temporaries, the
self-conditioning softmax). Both samplers here take the decoder's hidden states for a chunk of
rows and return only canvas-sized results plus the next step's self-conditioning signal as its
canvas x hidden soft embedding, so nothing vocab-sized outlives the chunk and the transient peak
does not grow with the batch.

- ``exact_row``: one row, HF's own expressions on HF's own shapes (lm_head, softcap, temperature
  as a 0-dim float32 tensor, softmax, ``multinomial`` as argmax(p / Exp(1)) with the noise drawn
  here just in time from the row's generator, Categorical entropy, the decoder's soft-embedding
  matmul), so a sequence stays bit-exact with ``generate()`` run alone.
- ``fast_chunk``: fused and in place (softcap and temperature on one buffer, one max pass for
  argmax and the log-softmax shift, entropy and soft embedding from one exp), sampling by
  inverse CDF with one uniform per position (C draws, not C x V), from a counter-based hash
  of (seed, step, position) so rows need no generator and a row's draws never depend on its
  batch mates. With ``compiled_vocab`` (``Scratch(compiled=True)``) a row that needs nothing
  but its draws takes the same math blocked over the vocabulary (``diffusiongemma_blocked``), or on
  a device (``batched``) as one compiled graph per chunk (``diffusiongemma_batched``).
"""

from __future__ import annotations

import logging

import torch

from diffusion_plugin.batcher.batch import Pins
from diffusion_plugin.batcher.request import SamplingParams, Score
from diffusion_plugin.families.diffusiongemma_batched import Batched, exponents, inverse_cdf
from diffusion_plugin.families.diffusiongemma_blocked import Blocked
from diffusion_plugin.step import filters
from diffusion_plugin.step.attention import MIN_EXPONENT, TINY_EXP
from diffusion_plugin.step.staging import stage

logger = logging.getLogger(__name__)


def temperature(p: SamplingParams, steps_left: int, device: torch.device | str = "cpu") -> torch.Tensor:
    # a tensor on the canvas's device, exactly as HF (float32 maths; a CPU scalar divides a CUDA
    # tensor by another path)
    cur_step = torch.tensor(steps_left, dtype=torch.int32, device=device)
    return p.t_min + ((p.t_max - p.t_min) * (cur_step / p.max_denoising_steps))


@torch.no_grad()
def exact_row(model, hidden: torch.Tensor, p: SamplingParams, steps_left: int, generator: torch.Generator,
              produced: int = 0, pins: Pins | None = None):
    """One row (1, C, H) -> (sampled, argmax, entropy, renoise) each (1, C), soft (1, C, H), with
    ``p.logprobs`` set the top (logprobs, ids) each (C, max(k, 1)) (else None), and with ``pins``
    their ``Score``s (else None). ``p``'s sampling fields (``filters``; a block ``produced`` tokens
    in) mask the processed logits; without any, HF's step exactly."""
    # HF's expressions one by one (DiffusionGemmaForBlockDiffusion.forward, generate()'s sampler,
    # torch's Categorical.entropy), with each elementwise op done in place where its input is not
    # needed again: the same kernel gives the same bits, and at most three canvas x vocab buffers
    # are alive at once instead of six.
    cap = model.final_logit_softcapping
    logits = model.lm_head(hidden).to(torch.float32)  # ours alone: safe to overwrite
    logits.div_(cap)
    logits.tanh_()
    logits.mul_(cap)
    t = temperature(p, steps_left, logits.device)
    processed = logits.div_(t)
    if p.filtered(produced):
        filters.apply(processed[0], p, produced, float(t))
    top, scores = _tops(processed[0], p.logprobs, pins)
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    # The decoder's own self-conditioning expression (softmax of the processed logits @ embedding).
    embed = model.model.decoder.embed_tokens
    soft = torch.matmul(probs.to(embed.weight.dtype), embed.weight) * embed.embed_scale.to(hidden.dtype)
    # torch.multinomial(probs, 1) on CPU is argmax(probs / q), q ~ Exp(1) drawn by exponential_
    # on a tensor shaped like probs (its no-replacement path): drawn now, from the row's generator.
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    sampled = torch.argmax(torch.div(probs, noise, out=noise), dim=-1)
    del noise, probs
    renoise = torch.randint(low=0, high=model.config.text_config.vocab_size, size=sampled.shape, generator=generator,
                            device=sampled.device)
    argmax = torch.argmax(processed, dim=-1)
    # Categorical(logits=processed).entropy(): normalise, softmax, clamp, p * log p, -sum.
    normalised = processed.sub_(processed.logsumexp(dim=-1, keepdim=True))
    del processed
    p_norm = torch.softmax(normalised, dim=-1)
    entropy = -normalised.clamp_(min=torch.finfo(normalised.dtype).min).mul_(p_norm).sum(-1)
    return sampled, argmax, entropy, renoise, soft, top, scores


def _tops(x: torch.Tensor, k: int | None, pins: Pins | None, log_total: torch.Tensor | None = None):
    """A row's top logprobs (``k`` set) and its pins' scores, from its (C, V) logits (any shift)."""
    if k is None and pins is None:
        return None, None
    log_total = torch.logsumexp(x, -1) if log_total is None else log_total
    top = None if k is None else top_logprobs(x, k, log_total)
    return top, None if pins is None else pin_scores(x, log_total, pins)


def read_scores(model, hidden: torch.Tensor, tokens: list[int]) -> list[Score]:
    """A label read (``request.BlockPlan.reads``): each token's ``Score`` at the first canvas
    position of one row's (1, C, H) hidden states, at temperature 1, the head on that position alone."""
    cap = model.final_logit_softcapping
    x = model.lm_head(hidden[0, :1]).to(torch.float32)
    if cap:
        x = torch.tanh(x / cap) * cap
    return pin_scores(x, torch.logsumexp(x, -1), Pins([0] * len(tokens), list(tokens), 0))


def pin_scores(x: torch.Tensor, log_total: torch.Tensor, pins: Pins) -> list[Score]:
    """Each pinned position's ``Score``: its token's log-softmax, rank and the top ``pins.k``
    (a few positions at a time: no canvas x vocab copy)."""
    out = []
    if not pins.positions:
        return out
    staged = stage(x.device, pos=(torch.long, pins.positions), tok=(torch.long, pins.tokens))  # (one copy)
    for s in range(0, len(pins.positions), 32):
        pos, tok = staged["pos"][s:s + 32], staged["tok"][s:s + 32]
        xs = x.index_select(0, pos)
        chosen = xs.gather(-1, tok[:, None])
        rank = (xs > chosen).sum(-1) + 1
        lt = log_total.index_select(0, pos)
        values, ids = torch.topk(xs, max(pins.k, 1), dim=-1)
        values = (values - lt[:, None]).tolist()
        for lp, r, v, i in zip((chosen[:, 0] - lt).tolist(), rank.tolist(), values, ids.tolist(), strict=True):
            out.append(Score(lp, r, [(t, x_) for t, x_ in zip(i[:pins.k], v[:pins.k], strict=True)
                                     if x_ != float("-inf")]))
    return out


@torch.no_grad()
def exact_row_constrained(model, hidden: torch.Tensor, p: SamplingParams, steps_left: int,
                          generator: torch.Generator, grammar, produced: int = 0):
    """``exact_row`` for a row under a grammar (``diffusion_plugin.step.grammar``): HF's expressions
    and random draws in HF's order (so its generator advances as an unconstrained row's), the
    argmax and the multinomial (argmax of probs / Exp(1) noise) restricted position by position
    to what the grammar allows, then softmax, soft embedding, entropy and logprobs of the
    distribution masked by the argmax canvas's masks. Not HF's (HF has no grammar)."""
    from diffusion_plugin.step.grammar import masked_argmax

    cap = model.final_logit_softcapping
    processed = model.lm_head(hidden).to(torch.float32)
    processed.div_(cap).tanh_().mul_(cap)
    t = temperature(p, steps_left, processed.device)
    processed.div_(t)
    if p.filtered(produced):
        filters.apply(processed[0], p, produced, float(t))
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    ratio = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, ratio, out=ratio)
    del probs
    sampled_u = torch.argmax(ratio, dim=-1)
    renoise = torch.randint(low=0, high=model.config.text_config.vocab_size, size=sampled_u.shape,
                            generator=generator, device=sampled_u.device)
    argmax_u = torch.argmax(processed, dim=-1)
    a, s = grammar.draft(argmax_u[0].tolist(), sampled_u[0].tolist(),
                         lambda j, ids: masked_argmax(processed[0, j], ids),
                         lambda j, ids: masked_argmax(ratio[0, j], ids))
    ratio = None  # freed before the masked pass below (one canvas x vocabulary buffer fewer)
    xgr_apply(processed[0], grammar.masks)
    argmax = torch.tensor([a], dtype=argmax_u.dtype, device=argmax_u.device)
    sampled = torch.tensor([s], dtype=sampled_u.dtype, device=sampled_u.device)
    top = None if p.logprobs is None else top_logprobs(processed[0], p.logprobs, torch.logsumexp(processed[0], -1))
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    embed = model.model.decoder.embed_tokens
    soft = torch.matmul(probs.to(embed.weight.dtype), embed.weight) * embed.embed_scale.to(hidden.dtype)
    del probs
    normalised = processed.sub_(processed.logsumexp(dim=-1, keepdim=True))
    p_norm = torch.softmax(normalised, dim=-1)
    entropy = -normalised.clamp_(min=torch.finfo(normalised.dtype).min).mul_(p_norm).sum(-1)
    return sampled, argmax, entropy, renoise, soft, top, None


def xgr_apply(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """-inf, in place, wherever a position's mask (one row of ``masks`` per row of ``logits``)
    refuses a token (xgrammar's CPU kernel took 4x as long at the real shape)."""
    from diffusion_plugin.step.grammar import refused

    logits.masked_fill_(refused(masks, logits.shape[-1]).to(logits.device), float("-inf"))


def top_logprobs(x: torch.Tensor, k: int, log_total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, V) logits (any shift), their log-normaliser (C,) -> the top max(k, 1) log-softmax
    values and ids, each (C, max(k, 1)): a requesting row only, read from the chunk's tensor."""
    values, ids = torch.topk(x, max(k, 1), dim=-1)
    return values - log_total[:, None], ids


class Scratch:
    """Two reusable (rows, C, V) float32 buffers for ``fast_chunk``: a fresh 256 MiB tensor per
    op costs its page faults every time (~0.1 s on one CPU core, as much as the op itself).
    Fixed memory (two canvas x vocab units per row in flight), not per sequence.

    ``compiled`` (the host's default): a row with no filter, grammar, top logprobs or pinned
    scores takes the pass blocked over the vocabulary (``diffusiongemma_blocked``: nothing
    vocabulary-sized written), or with ``batched`` (a device's form) its chunk's pass as one
    compiled graph (``diffusiongemma_batched``); a chunk with top logprobs or pinned scores but no
    filter and no grammar, the elementwise math as one inductor kernel per row (``_vocab_math``)."""

    def __init__(self, compiled: bool = False, batched: bool = False):
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fused = _compiled_math() if compiled else None
        self.plain = (Batched() if batched else Blocked()) if compiled else None

    def warm(self, model, canvas: int, device) -> None:
        """Compiles the compiled passes now (at engine start), not in the first request's step."""
        if self.plain is not None and self.plain.takes(model.lm_head.weight):
            self.plain.warm(model, canvas, device)
        if self.fused is not None:
            x, e = self.get((1, canvas, model.lm_head.weight.shape[0]), device)
            x.zero_()
            self.run_fused(x, e, torch.ones(1, device=device), float(model.final_logit_softcapping))

    def instrument(self, wrap) -> None:
        """``FastPasses.instrument``: the compiled plain pass (the device form's) as ``wrap("vocab", eager)``."""
        if self.plain is not None and hasattr(self.plain, "instrument"):
            self.plain.instrument(wrap)

    def run_plain(self, model, hidden: torch.Tensor, inv_t: torch.Tensor, uniform: torch.Tensor):
        """The plain rows' pass (``Blocked``: one row at a time, float32 only; ``Batched``: the
        chunk in one graph): (sampled, argmax, entropy, soft) of ``hidden``'s rows; None if none
        takes them or it failed, and from then on the other passes serve."""
        if self.plain is None or not self.plain.takes(model.lm_head.weight):
            return None
        try:
            return self.plain.run(model, hidden, inv_t, uniform)
        except Exception:  # noqa: BLE001 - the one place a failure of the plain pass is handled
            logger.exception("the %s vocabulary pass failed; the other passes serve from now on",
                             type(self.plain).__name__.lower())
            self.plain = None
            return None

    def run_fused(self, x: torch.Tensor, e: torch.Tensor, inv_t: torch.Tensor, cap: float):
        """The fused pass, one row at a time (the same kernel and shape whatever the batch):
        (total, argmax, entropy) of ``x``'s rows; None if it failed, and from then on the eager
        passes serve (no C++ compiler, an inductor failure), ``x`` left to be recomputed."""
        try:
            parts = [self.fused(x[b:b + 1], e[b:b + 1], inv_t[b:b + 1], cap) for b in range(x.shape[0])]
        except Exception:  # noqa: BLE001 - the one place a failure of the compiled pass is handled
            logger.exception("the compiled vocabulary pass failed; the eager passes serve from now on")
            self.fused = None
            return None
        return tuple(torch.cat(xs) for xs in zip(*parts, strict=True))

    def get(self, shape: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bufs is None or self._bufs[0].shape[1:] != shape[1:] or self._bufs[0].shape[0] < shape[0]:
            self._bufs = (torch.empty(shape, device=device), torch.empty(shape, device=device))
        return self._bufs[0][:shape[0]], self._bufs[1][:shape[0]]


@torch.no_grad()
def fast_chunk(model, hidden: torch.Tensor, inv_t: torch.Tensor, uniform: torch.Tensor, scratch: Scratch,
               ks: list[int | None] | None = None, grammars: list | None = None, uniform2: torch.Tensor | None = None,
               filtered: list | None = None, pins: list | None = None):
    """R rows (R, C, H), 1/temperature (R,), one uniform per position (R, C) float64 ->
    (sampled, argmax, entropy) each (R, C), the soft embedding (R, C, H), and per row its top
    (logprobs, ids) if ``ks[row]`` is not None (``top_logprobs``), else None. ``grammars``: per
    row a ``grammar.RowGrammar`` or None; a constrained row's canvases follow its grammar
    (``_fast_draft``, with a second uniform per position, ``uniform2``) and its distribution is
    masked by its argmax canvas's masks; the other rows' work is unchanged. ``filtered``: per row
    None or (params, produced) for ``filters.prepare``/``cut`` (a refused token gets no mass);
    ``pins``: per row None or its ``Pins``, whose ``Score``s come back as a sixth result."""
    cap = model.final_logit_softcapping
    weight = model.lm_head.weight
    R, C, _ = hidden.shape
    if not any(x is not None for x in (*(filtered or []), *(grammars or []), *(ks or []), *(pins or []))):
        plain = scratch.run_plain(model, hidden, inv_t, uniform)
        if plain is not None:
            return (*plain, [None] * R, [None] * R)
    x, e = scratch.get((R, C, weight.shape[0]), hidden.device)
    _head(hidden, weight, x)
    filtered = [(b, f) for b, f in enumerate(filtered or []) if f is not None]
    if scratch.fused is not None and not filtered and not any(g is not None for g in grammars or []):
        fused = scratch.run_fused(x, e, inv_t, cap)
        if fused is not None:
            return _finish(model, x, e, *fused, uniform, weight, hidden, ks, pins, [], {}, R)
        _head(hidden, weight, x)
    x.div_(cap).tanh_().mul_((cap * inv_t).to(x.dtype)[:, None, None])  # softcap, then / temperature
    for b, (params, produced) in filtered:
        filters.prepare(x[b], params, produced, 1.0 / float(inv_t[b]))
    drafts = {b: _fast_draft(g, x[b], e[b], uniform[b], uniform2[b])
              for b, g in enumerate(grammars or []) if g is not None}
    for b in drafts:
        xgr_apply(x[b], grammars[b].masks)  # the argmax canvas's masks: -inf where refused
    top, argmax = x.max(dim=-1)
    # Log-probabilities up to the log-normaliser, clamped where exp() would give a denormal
    # (a matmul over denormals is ~60x slower on CPU): a token below e^-87 of the top one keeps
    # that much mass, ~1e-33 of the total over the whole vocab.
    x.sub_(top[..., None]).clamp_(min=MIN_EXPONENT)
    torch.exp(x, out=e)
    # ...and an exponent below e^-69 (1e-30) is zero: multiplied by an embedding weight in the
    # soft-embedding matmul, e^-87 gives denormal products, and a near-greedy step (temperature 0:
    # every position but a few at e^-87) ran that matmul ~25x slower (169 s a request on the
    # 8-layer shape model instead of 8). The mass dropped is < 262,144 x 1e-30 of the total.
    torch.nn.functional.threshold_(e, TINY_EXP, 0.0)  # (attention.TINY_EXP)
    for b, (params, produced) in filtered:  # a refused token: no mass, so never drawn
        filters.cut(x[b], e[b], params, produced)
    total = e.sum(-1)
    return _finish(model, x, e, total, argmax, None, uniform, weight, hidden, ks, pins, filtered, drafts, R)


def _head(hidden: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> None:
    """The lm_head's logits into ``x``."""
    if weight.dtype == torch.float32:
        torch.matmul(hidden, weight.t(), out=x)
    else:
        x.copy_(torch.matmul(hidden, weight.t()))


def _finish(model, x, e, total, argmax, entropy, uniform, weight, hidden, ks, pins, filtered, drafts, R):
    """``fast_chunk``'s second half, from the exponents ``e`` of the shifted logits ``x`` and
    their sums: the soft embedding, the draw, top logprobs, pinned scores, the entropy (if not
    given) and the grammar's canvases."""
    embed = model.model.decoder.embed_tokens
    soft = torch.matmul(e.to(weight.dtype), embed.weight) / total[..., None].to(weight.dtype)
    soft = soft * embed.embed_scale.to(hidden.dtype)
    sampled = inverse_cdf(e, uniform)
    tops = [None if k is None else top_logprobs(x[b], k, torch.log(total[b])) for b, k in enumerate(ks or [None] * R)]
    for b, _ in filtered:  # a refused token is no candidate (-inf: left out)
        if tops[b] is not None:
            values, ids = tops[b]
            tops[b] = (values.masked_fill(e[b].gather(-1, ids) == 0, float("-inf")), ids)
    scores = [None if q is None else pin_scores(x[b], torch.log(total[b]), q) for b, q in enumerate(pins or [None] * R)]
    if entropy is None:  # of softmax(x): log S - sum(e * x) / S (x shifted by its max, so S >= 1)
        entropy = torch.log(total) - x.mul_(e).sum(-1) / total
    for b, (a, s) in drafts.items():
        argmax[b] = torch.tensor(a, dtype=argmax.dtype, device=argmax.device)
        sampled[b] = torch.tensor(s, dtype=sampled.dtype, device=sampled.device)
    return sampled, argmax, entropy, soft, tops, scores


def _vocab_math(x: torch.Tensor, e: torch.Tensor, inv_t: torch.Tensor, cap: float):
    """The eager passes of ``fast_chunk`` as one function of a row's head logits ``x`` (1, C, V):
    softcap and temperature, the max, ``x`` shifted by it (clamped), its exponents into ``e``
    (zero at or below ``TINY_EXP``), their sum and the entropy. ``x`` and ``e`` are written in place.
    The softcap's tanh(u) is taken as 1 - 2 / (exp(2u) + 1): within 1.4e-7 of tanh (a logit moves
    by at most 30 x that), and a third of its CPU here (tanh alone was 0.17 s of a canvas x
    vocabulary, exp 0.06); exp's overflow at |u| > 44 gives the limits +-1 exactly."""
    z, exps, total, argmax, entropy = exponents(x, inv_t, cap)
    e.copy_(exps)
    x.copy_(z)
    return total, argmax, entropy


def _compiled_math():
    """``_vocab_math`` under inductor (compiled at its first call, a few seconds per shape): its
    passes fused into C++ loops over the canvas x vocabulary (``python -m tandem_tools.bench.vocab``
    measures it against the eager passes and the two GEMMs)."""
    return torch.compile(_vocab_math, dynamic=False)


def _fast_draft(grammar, x: torch.Tensor, e: torch.Tensor, uniform: torch.Tensor,
                uniform2: torch.Tensor) -> tuple[list[int], list[int]]:
    """One constrained row's (argmax, sampled) canvases (``grammar.RowGrammar.draft``) from its
    processed logits (C, V), before any masking: the unconstrained argmax and inverse-CDF draw
    (``e``, the row's exponent buffer, as scratch) are taken where the grammar allows them; else
    the argmax over the allowed ids, or a draw from the allowed ids' renormalised probabilities
    with the position's second uniform."""
    from diffusion_plugin.step.grammar import masked_argmax

    top, argmax = x.max(dim=-1)
    torch.sub(x, top[:, None], out=e).clamp_(min=MIN_EXPONENT).exp_()
    sampled = inverse_cdf(e[None], uniform[None])[0]
    u2 = uniform2.tolist()

    def sample_in(j: int, ids) -> int:
        idx = torch.from_numpy(ids)
        v = x[j, idx]
        cdf = torch.exp(v - v.max()).cumsum(0, dtype=torch.float64)
        k = int(torch.searchsorted(cdf, torch.tensor([u2[j] * float(cdf[-1])], dtype=torch.float64), right=True))
        return int(idx[min(k, len(ids) - 1)])

    return grammar.draft(argmax.tolist(), sampled.tolist(), lambda j, ids: masked_argmax(x[j], ids), sample_in)
