"""What a model family gives the diffusion engine: the one interface the runner, the row state,
the intake and the memory planner use (``families/`` holds the implementations; ``families.ADAPTERS``
names them). Nothing here imports torch or a family: a family module may import this one, never
the reverse.

A family is an adapter object over a loaded checkpoint:
- **shape and tokens**: ``canvas_length``, ``vocab_size``, ``eos_token_ids``, ``max_position``,
  ``tokenizer`` (a Hugging Face tokenizer), ``device``, ``dtype``, ``defaults()`` (the
  checkpoint's per-request knobs: ``max_denoising_steps``, ``entropy_bound``, ``t_min``, ``t_max``,
  ``stability_threshold``, ``confidence_threshold``);
- **memory**: ``memory_shape()`` (``memory.MemoryShape``), ``kv_layout()`` (the KV page pool's
  per-layer shape), ``new_cache(pool)`` (a sequence's cache: HF's in exact mode, pages of ``pool``
  in fast mode);
- **forward passes**: ``encode(caches, token_ids, starts, images)`` (prompts and committed blocks
  into their caches) and ``decode_hidden(canvas, view, positions, soft)`` (the batched decoder
  over canvases -> hidden states), ``fast_experts(on)`` (a context: the batch-invariant MoE of
  fast mode, or the checkpoint's own);
- **the vocabulary pass**: ``vocab_scratch(compiled, batched)`` (fast mode's reusable buffers;
  ``batched``: a device's form of the compiled passes; a scratch's optional ``instrument(wrap)``
  hands its compiled pass to a measuring tool, as ``FastPasses.instrument`` does),
  ``warm_vocab(scratch)``, ``vocab_fast(hidden, inv_t, uniform, scratch, ks, grammars, uniform2,
  filtered, pins)`` (a chunk of rows) and ``vocab_exact(hidden, p, steps_left, generator,
  produced, pins, grammar)`` (one row, bit-exact with the reference ``generate()``), each returning
  (sampled, argmax, entropy, soft embedding, top logprobs, pinned scores[, renoise]);
- **a label read** (decisions): ``read_scores(hidden, tokens)``, each token's ``request.Score`` at
  the canvas's first position of one row's (1, C, H) hidden states, at temperature 1;
- **the sampler's start**: ``init_canvas(generator)``;
- **images** (a family with vision): ``has_vision``, ``encode_images(images)``,
  ``expand_image_tokens(ids, soft_tokens)``.
"""

from __future__ import annotations

from typing import Any, Protocol


class Family(Protocol):
    canvas_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_position: int | None
    tokenizer: Any
    device: Any
    has_vision: bool

    @property
    def dtype(self) -> Any: ...

    def defaults(self) -> dict: ...

    def memory_shape(self) -> Any: ...

    def kv_layout(self) -> list[tuple[int, int]]: ...

    def new_cache(self, pool=None) -> Any: ...

    def encode(self, caches: list, token_ids: list, starts: list[int], images: list | None = None) -> None: ...

    def decode_hidden(self, canvas, view, positions, soft) -> Any: ...

    def fast_experts(self, on: bool) -> Any: ...

    def vocab_scratch(self, compiled: bool = False, batched: bool = False) -> Any: ...

    def warm_vocab(self, scratch) -> None: ...

    def vocab_fast(self, hidden, inv_t, uniform, scratch, ks=None, grammars=None, uniform2=None, filtered=None,
                   pins=None) -> tuple: ...

    def vocab_exact(self, hidden, p, steps_left: int, generator, produced: int, pins=None, grammar=None) -> tuple: ...

    def read_scores(self, hidden, tokens: list[int]) -> list: ...

    def init_canvas(self, generator) -> Any: ...

    def encode_images(self, images: list) -> Any: ...

    def expand_image_tokens(self, ids: list[int], num_soft_tokens: list[int]) -> list[int]: ...
