"""A second diffusion model family, registered from the test package alone
(``families.ADAPTERS["toy"] = "tests.toy_family:ToyAdapter"``): a minimal masked-diffusion model
on a tiny random trunk (an embedding and one mixing matrix over the prompt's mean), exact sampler
only. It implements ``diffusion_plugin.family.Family`` and nothing else: if the engine, the
scheduler or the runner reached past that interface to DiffusionGemma, it would fail here."""

from __future__ import annotations

import contextlib

import torch

from diffusion_plugin.batcher.memory import MemoryShape

CANVAS, HIDDEN = 8, 16


class ToyCache:
    """A sequence's cache: the token ids encoded so far (prompt and committed blocks)."""

    def __init__(self):
        self.ids: list[torch.Tensor] = []


class ToyAdapter:
    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu", num_threads: int | None = None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)  # a checkpoint's tokenizer (any)
        self.vocab_size = len(self.tokenizer)
        self.canvas_length = CANVAS
        self.eos_token_ids = (self.tokenizer.eos_token_id,)
        self.max_position = None
        self.device = torch.device(device)
        self.has_vision = False
        g = torch.Generator().manual_seed(7)
        self.embed = torch.randn(self.vocab_size, HIDDEN, generator=g)
        self.mix = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def defaults(self) -> dict:
        return {"max_denoising_steps": 3, "entropy_bound": 0.5, "t_min": 0.5, "t_max": 1.0,
                "stability_threshold": 1, "confidence_threshold": 0.01}

    def memory_shape(self) -> MemoryShape:
        return MemoryShape(canvas_length=CANVAS, vocab_size=self.vocab_size, hidden_size=HIDDEN, itemsize=4,
                           layers=((HIDDEN, None),), num_heads=1)

    def kv_layout(self) -> list[tuple[int, int]]:
        return [(1, HIDDEN)]

    def new_cache(self, pool=None) -> ToyCache:
        if pool is not None:
            raise NotImplementedError("the toy family runs the exact sampler only")
        return ToyCache()

    def encode(self, caches: list, token_ids: list, starts: list[int], images=None) -> None:
        for cache, ids in zip(caches, token_ids, strict=True):
            cache.ids.append(ids.reshape(-1))

    def decode_hidden(self, canvas: torch.Tensor, cache, positions, soft) -> torch.Tensor:
        context = self.embed[torch.cat(cache.ids)].mean(0) @ self.mix
        hidden = self.embed[canvas] + context
        return hidden if soft is None else hidden + soft

    def fast_experts(self, on: bool):
        return contextlib.nullcontext()

    def vocab_scratch(self, compiled: bool = False, batched: bool = False):
        return None

    def warm_vocab(self, scratch) -> None:
        pass

    def vocab_fast(self, *args, **kwargs):
        raise NotImplementedError("the toy family runs the exact sampler only")

    def vocab_exact(self, hidden, p, steps_left: int, generator, produced: int, pins=None, grammar=None):
        t = p.t_min + (p.t_max - p.t_min) * steps_left / p.max_denoising_steps
        logits = (hidden[0] @ self.embed.t()) / t
        probs = torch.softmax(logits, -1)
        argmax = probs.argmax(-1)
        sampled = torch.multinomial(probs, 1, generator=generator)[:, 0]
        renoise = torch.randint(0, self.vocab_size, (CANVAS,), generator=generator)
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        soft = probs @ self.embed
        tops = None
        if p.logprobs is not None:
            values, ids = torch.topk(torch.log_softmax(logits, -1), max(p.logprobs, 1), dim=-1)
            tops = (values, ids)
        return (sampled[None], argmax[None], entropy[None], renoise[None], soft[None], tops, None)

    def init_canvas(self, generator) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (1, CANVAS), generator=generator)

    def encode_images(self, images: list):
        raise NotImplementedError

    def expand_image_tokens(self, ids: list[int], num_soft_tokens: list[int]) -> list[int]:
        raise NotImplementedError
