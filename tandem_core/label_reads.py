"""Label reads, shared by both engines: how probable each label is as the start of the model's
reply to a question (``tandem_core.decisions``, vLLM's ``/v1/systemone`` on diffusion models).

A label is read as a token sequence, never assumed to be one token: its log-probability is the
sum of its tokens' next-token log-probabilities, each after the prompt and the label's tokens
before it. The reads of one question form a trie of the labels' prefixes: one engine read
(``Probe``) per distinct prefix, asking for the log-probabilities of the next tokens the labels
continue with. Single-token labels (``A``..``Z`` on most tokenizers) take one read per question.
Every read of a question starts with the same prompt, so the engine's prefix cache serves it
once. An engine implements ``Reader``: it renders chat messages to token ids and runs probes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem_core.errors import TandemError

TAIL_TOKENS = 32  # a label is tokenized after at most this much of the prompt's end


@dataclass(frozen=True)
class Probe:
    """One engine read: the next-token log-probabilities of ``candidates`` after ``prompt_ids``,
    whose first ``prompt_len`` tokens are the question's rendered prompt (the rest a label's prefix)."""

    prompt_ids: list[int]
    candidates: list[int]
    prompt_len: int = 0


@dataclass(frozen=True)
class ProbeResult:
    logprobs: list[float]  # per candidate: its log-softmax over the whole vocabulary
    argmax: int | None  # the most probable next token (None: unknown)
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served


@dataclass(frozen=True)
class Ask:
    """One question for the reader: its chat messages and its labels' texts."""

    messages: list[dict]
    labels: Sequence[str]
    images: bool = False  # the question shows an image


@dataclass
class LabelRead:
    probs: list[float] | None = None  # among the labels, summing to 1; None: refused
    label_mass: float = 0.0  # the labels' total probability over the vocabulary
    argmax_is_label: bool = False
    input_tokens: int = 0
    cached_tokens: int = 0
    refusal: str | None = None


class Reader(Protocol):
    tokenizer: object  # encode/decode (HF-like)
    max_len: int  # the model's context
    sees: bool  # it takes images
    chunk: int  # probes per engine call

    async def render(self, messages: list[dict], salt: str | None) -> list[int]:
        """The chat prompt's token ids up to the reply. Raises TandemError."""

    async def probe(self, probes: list[Probe], salt: str | None) -> list[ProbeResult]:
        """One result per probe, in order. Raises TandemError."""


@dataclass
class _Plan:
    prompt: list[int]
    seqs: list[tuple[int, ...]]
    nodes: list[tuple[int, ...]] = field(default_factory=list)  # the trie's inner prefixes, read in order


async def read_labels(reader: Reader, asks: list[Ask], salt: str | None) -> list[LabelRead]:
    """Each question's label probabilities (or its refusal), in order."""
    reads = [LabelRead() for _ in asks]
    cache: dict = {}
    # Rendered together: an engine's renderer may tokenize off the event loop, in parallel.
    plans = await asyncio.gather(*(_plan(reader, ask, salt, read, cache) for ask, read in zip(asks, reads,
                                                                                                strict=True)))
    probes, owners = [], []
    for i, plan in enumerate(plans):
        if plan is None:
            continue
        for node in plan.nodes:
            children = sorted({s[len(node)] for s in plan.seqs if len(s) > len(node) and s[:len(node)] == node})
            probes.append(Probe(plan.prompt + list(node), children, len(plan.prompt)))
            owners.append((i, node))
    results: list[ProbeResult | None] = [None] * len(probes)
    for wave in _waves(owners, max(1, reader.chunk)):
        for k, res in zip(wave, await reader.probe([probes[k] for k in wave], salt), strict=True):
            results[k] = res
    table: dict[int, dict[tuple[int, ...], dict[int, float]]] = {}
    for (i, node), probe, res in zip(owners, probes, results, strict=True):
        table.setdefault(i, {})[node] = dict(zip(probe.candidates, res.logprobs, strict=True))
        reads[i].input_tokens += len(probe.prompt_ids)
        reads[i].cached_tokens += res.cached_tokens
        if not node:
            reads[i].argmax_is_label = res.argmax in {s[0] for s in plans[i].seqs}
    for i, plan in enumerate(plans):
        if plan is not None:
            lps = [sum(table[i][s[:j]][s[j]] for j in range(len(s))) for s in plan.seqs]
            top = max(lps)
            weights = [math.exp(lp - top) for lp in lps]
            total = sum(weights)
            reads[i].probs = [w / total for w in weights]
            reads[i].label_mass = min(1.0, sum(math.exp(lp) for lp in lps))
    return reads


def _waves(owners: list[tuple[int, tuple]], chunk: int) -> list[list[int]]:
    """The probes' order, as engine calls of at most ``chunk``: the first question's root alone
    (the input every question shares is then in the engine's prefix cache before the others are
    admitted: rows admitted together cannot share pages still being written), then the roots of
    the rest, then each deeper level of the tries (a label prefix's probe finds its question's
    prompt cached by the root's)."""
    if not owners:
        return []
    order = sorted(range(1, len(owners)), key=lambda k: (len(owners[k][1]), k))
    waves, wave = [[0]], []
    for k in order:
        if wave and (len(wave) == chunk or len(owners[k][1]) != len(owners[wave[-1]][1])):
            waves.append(wave)
            wave = []
        wave.append(k)
    if wave:
        waves.append(wave)
    return waves


async def _plan(reader: Reader, ask: Ask, salt: str | None, read: LabelRead, cache: dict) -> _Plan | None:
    if ask.images and not reader.sees:
        read.refusal = "the question shows an image, and this model does not take images"
        return None
    try:
        prompt = await reader.render(ask.messages, salt)
    except TandemError as e:
        read.refusal = e.message
        return None
    seqs = [label_ids(reader.tokenizer, prompt, label, cache) for label in ask.labels]
    if len(set(seqs)) != len(seqs) or any(a != b and b[:len(a)] == a for a in seqs for b in seqs):
        read.refusal = "the labels are not distinct token sequences for this model"
        return None
    longest = max(map(len, seqs))
    if len(prompt) + longest > reader.max_len:
        read.refusal = (f"the question's prompt ({len(prompt)} tokens) and its labels do not fit the model's "
                        f"context ({reader.max_len} tokens)")
        return None
    nodes = sorted({s[:j] for s in seqs for j in range(len(s))}, key=lambda n: (len(n), n))
    return _Plan(prompt, seqs, nodes)


def label_ids(tokenizer, prompt_ids: list[int], label: str, cache: dict | None = None) -> tuple[int, ...]:
    """The tokens ``label`` adds after ``prompt_ids`` as the reply's start: the label is tokenized
    with the prompt's end (after its last added token, at most ``TAIL_TOKENS``), so a tokenizer
    that merges across the boundary or marks a word's start is read as it would write it."""
    added = _added(tokenizer, cache)
    start = max((i + 1 for i, t in enumerate(prompt_ids) if t in added), default=0)
    tail = tuple(prompt_ids[max(start, len(prompt_ids) - TAIL_TOKENS):])
    key = (tail, label)
    if cache is not None and key in cache:
        return cache[key]
    text = tokenizer.decode(list(tail))
    ext = tokenizer.encode(text + label, add_special_tokens=False)
    if tuple(ext[:len(tail)]) == tail and len(ext) > len(tail):
        ids = tuple(ext[len(tail):])
    else:
        ids = tuple(tokenizer.encode(label, add_special_tokens=False))
    if cache is not None:
        cache[key] = ids
    return ids


def _added(tokenizer, cache: dict | None) -> set[int]:
    if cache is not None and "_added" in cache:
        return cache["_added"]
    get = getattr(tokenizer, "get_added_vocab", None)
    added = set(get().values()) if callable(get) else set()
    if cache is not None:
        cache["_added"] = added
    return added
