"""Grammar-constrained canvases: structured outputs on a block-diffusion model (xgrammar).

**The rule**: every committed token is allowed by the grammar given everything committed before
it, so a finished response always parses; once the grammar has ended (it accepted an
end-of-sequence token) every later position is end-of-sequence, and the response finishes there
with ``stop`` (or ``length`` if ``max_tokens`` cuts it first).

**In the canvas, every step** (``RowGrammar.draft``, called by the vocab pass of each
constrained row; an unconstrained row never comes here): the step's two canvases are built
left to right in canvas order from the matcher at the row's committed tokens:

- the *argmax* canvas: position j takes the most probable token the grammar allows after
  positions 0..j-1 of this canvas (the unconstrained argmax when it is allowed, which is one bit
  test; else the argmax over the allowed ids);
- the *sampled* canvas: position j takes the step's own draw when the grammar allows it after
  positions 0..j-1 of the sampled canvas, else a draw from the distribution restricted to the
  allowed ids with a second random number (a rejected draw redrawn from the restriction: the
  result is distributed as the restricted distribution). While the two canvases agree they share
  the matcher and its masks; where they part, the sampled one forks it.

The row's distribution at each position is then masked with the argmax canvas's masks, so its
entropy (the acceptance and convergence tests) and its self-conditioning signal describe the
draft that commits. At the block's commit, the committed tokens are exactly that argmax canvas:
the matcher keeps the state it reached (``settle(True)``); otherwise it rolls back.

**Cost** per constrained row and step: ``canvas_length`` mask fills (xgrammar's, over the
tokenizer), one more for each position after the canvases part, a bit test per position and an
allowed-id gather where the model's choice is refused, and one extra vocabulary-wide mask and
exponent pass for the masked distribution (``docs/benchmarks.md`` has the figures).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
import xgrammar as xgr

# JSON grammars allow whitespace between elements, as vLLM's do, but at most this many characters
# in a row: a canvas position is as cheap to fill with a space as with anything else, so unbounded
# whitespace let a (random) model pad a bounded schema past any max_tokens.
WHITESPACE = 8
TAG_CACHE = 64  # compiled structural tags kept, by exact spec (least recently used out)


class GrammarCompiler:
    """xgrammar's compiler over one model's tokenizer: built once per engine, compiled grammars
    cached by xgrammar. ``compile(kind, spec)`` takes vLLM's structured-output kinds."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], info=None):
        """``info``: an ``xgr.TokenizerInfo`` to use instead of the tokenizer's (benchmarks)."""
        if info is None:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        # xgrammar 0.2.8's cache mixes up structural tags' ``token`` elements: compiled after
        # another tag, a tag's later tokens are the other tag's (tests/unit/test_diffusion_grammar.py).
        # Structural tags are compiled without it, and kept here by their exact spec (an agent
        # sends the same tag every turn, and a compile over a 262,144-entry vocabulary takes seconds).
        self.uncached = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._tags: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._tag_lock = threading.Lock()
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        """``kind``: json (a schema), json_object, regex, grammar (EBNF or Lark), structural_tag.
        Raises whatever xgrammar raises for a spec it cannot compile (the caller makes it a 400)."""
        if kind in ("json", "json_object"):
            return self._json(spec if kind == "json" else '{"type": "object"}')
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "grammar":
            return self.compiler.compile_grammar(spec)
        if kind == "structural_tag":
            return self._structural_tag(spec)
        raise ValueError(f"bug: unknown structured output kind {kind!r}")


    def _structural_tag(self, spec: str) -> xgr.CompiledGrammar:
        with self._tag_lock:  # requests compile in worker threads
            if spec in self._tags:
                self._tags.move_to_end(spec)
                return self._tags[spec]
            compiled = self._tags[spec] = self.uncached.compile_structural_tag(spec)
            while len(self._tags) > TAG_CACHE:
                self._tags.popitem(last=False)
            return compiled

    def _json(self, schema: str) -> xgr.CompiledGrammar:
        """Strict JSON (what ``json.loads`` accepts, counted as a validator counts): xgrammar's
        rule for a string with a length bound admits raw control characters (and no escapes),
        which JSON forbids, and both its string rules admit the bytes of a UTF-16 surrogate
        (``ED A0..BF xx``) as one character, which decode to three U+FFFD (a random byte-level
        model wrote a 12-character name under ``maxLength: 10``). The grammar's EBNF is compiled
        with every string character class limited to scalar values, as JSON text's are."""
        grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=WHITESPACE))
        strict = grammar.replace(_LOOSE_CHARS, _STRICT_CHARS).replace(_PLAIN_CHARS, _STRICT_CHARS)
        return self.compiler.compile_grammar(strict)


_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'  # a length-bounded string's character
_PLAIN_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'  # an unbounded string's character
_STRICT_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n\\uD800-\\uDFFF]'


_BITS = np.arange(32, dtype=np.int64)


def allowed_ids(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row (uint32 words) allows: the set words first (a mask inside a
    JSON structure has a few of its 8,192 words set at the real vocabulary), then their bits."""
    words = np.flatnonzero(mask_row)
    bits = np.unpackbits(mask_row[words].view(np.uint8), bitorder="little").reshape(len(words), 32).astype(bool)
    ids = (words[:, None] * 32 + _BITS)[bits]
    return ids[ids < vocab_size]


def refused(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(positions, words) int32 bitmasks -> (positions, vocab_size) bool, True where refused."""
    flipped = np.invert(masks.numpy().view(np.uint8))
    return torch.from_numpy(np.unpackbits(flipped, axis=-1, bitorder="little")[:, :vocab_size]).view(torch.bool)


class RowGrammar:
    """One sequence's grammar: its matcher at the committed tokens, and the masks of the current
    step's argmax canvas (``masks``, (canvas, words) int32, for ``apply_token_bitmask_inplace``)."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, eos_token_ids: tuple[int, ...],
                 canvas_length: int):
        if not eos_token_ids:
            raise ValueError("bug: a constrained sequence needs an end-of-sequence token")
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.eos = eos_token_ids[0]
        self.masks = xgr.allocate_token_bitmask(canvas_length, vocab_size)
        self._masks = self.masks.numpy().view(np.uint32)
        self._fork_mask = xgr.allocate_token_bitmask(1, vocab_size)
        self._fork_masks = self._fork_mask.numpy().view(np.uint32)
        self._accepted = 0  # tokens the matcher took in this step's pass: rolled back unless committed
        self.seconds = 0.0  # spent in ``draft`` (masking), for the block's span

    def draft(self, argmax: list[int], sampled: list[int], argmax_in: Callable[[int, np.ndarray], int],
              sample_in: Callable[[int, np.ndarray], int]) -> tuple[list[int], list[int]]:
        """This step's (argmax canvas, sampled canvas) under the grammar, from the unconstrained
        ``argmax`` and ``sampled`` canvases; ``argmax_in(j, ids)`` / ``sample_in(j, ids)``: the
        argmax / a draw at position j restricted to ``ids``. Fills ``masks``."""
        t0 = time.perf_counter()
        try:
            return self._draft(argmax, sampled, argmax_in, sample_in)
        finally:
            self.seconds += time.perf_counter() - t0

    def _draft(self, argmax, sampled, argmax_in, sample_in) -> tuple[list[int], list[int]]:
        m, fork = self.matcher, None
        out_a, out_s = [], []
        for j, (cand_a, cand_s) in enumerate(zip(argmax, sampled, strict=True)):
            ended_a = m.is_terminated()
            if ended_a:
                self._only_eos(self._masks[j])
                a = self.eos
            else:
                m.fill_next_token_bitmask(self.masks, j)
                a = cand_a if self._allows(self._masks[j], cand_a) else self._pick(argmax_in, j, self._masks[j])
            fork_took = False  # whether the fork has already taken this position's token
            s_mask = self._masks[j]  # the mask the sampled token was picked under
            if fork is None:  # the sampled canvas is still the argmax canvas: same state, same mask
                s = self.eos if ended_a else (
                    cand_s if self._allows(self._masks[j], cand_s) else self._pick(sample_in, j, self._masks[j]))
                if s != a:
                    fork = m.fork()
            elif fork.is_terminated():
                s, fork_took = self.eos, True
            elif fork.accept_token(cand_s):  # allowed (the sampled canvas needs no mask of its own)
                s, fork_took = cand_s, True
            else:
                fork.fill_next_token_bitmask(self._fork_mask, 0)
                s_mask = self._fork_masks[0]
                s = self._pick(sample_in, j, s_mask)
            # A grammar that allows nothing at a position (a tokenizer that cannot spell what it
            # needs next) ends the output there: EOS, not fed to the matcher (which would refuse it).
            if not ended_a and self._allows(self._masks[j], a):
                self._accept(m, a)
                self._accepted += 1
            if fork is not None and not fork_took and not fork.is_terminated() and self._allows(s_mask, s):
                self._accept(fork, s)
            out_a.append(a)
            out_s.append(s)
        return out_a, out_s

    def settle(self, committed: bool) -> None:
        """After the step: the argmax canvas committed (keep the matcher's state), or not (roll it
        back to the committed tokens)."""
        if not committed and self._accepted:
            self.matcher.rollback(self._accepted)
        self._accepted = 0

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def _allows(mask_row: np.ndarray, token: int) -> bool:
        return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)

    def _pick(self, within: Callable[[int, np.ndarray], int], j: int, mask_row: np.ndarray) -> int:
        ids = allowed_ids(mask_row, self.vocab_size)
        if len(ids) == 0:  # a grammar that allows nothing here (not even an end): end the output
            return self.eos
        return int(within(j, ids))

    def _only_eos(self, mask_row: np.ndarray) -> None:
        mask_row[:] = 0
        mask_row[self.eos >> 5] = np.uint32(1 << (self.eos & 31))

    @staticmethod
    def _accept(matcher: xgr.GrammarMatcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"bug: the grammar refused token {token}, which its own mask allowed")


def masked_argmax(logits_row: torch.Tensor, ids: np.ndarray) -> int:
    """The argmax of one position's logits over ``ids`` (ties: the lowest id, as torch's argmax)."""
    idx = torch.from_numpy(ids)
    return int(idx[torch.argmax(logits_row[idx])])
