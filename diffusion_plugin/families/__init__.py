"""Model families: one adapter per family (loading, the model's forward passes, its memory
shape), picked by ``engine_args.family`` through ``ADAPTERS``, the only place a family's adapter
class is named."""

from __future__ import annotations

import importlib

# family -> "module:class" (imported when first used: an adapter imports transformers)
ADAPTERS = {
    "diffusiongemma": "diffusion_plugin.families.diffusiongemma:DiffusionGemmaAdapter",
}

# A checkpoint's config.json `architectures` entry -> its family (`tandem serve MODEL` detects the kind by it)
ARCHITECTURES = {
    "DiffusionGemmaForBlockDiffusion": "diffusiongemma",
}


def family_of(architectures: list[str]) -> str | None:
    """The family serving a checkpoint of these ``architectures``, None if none does (then it is
    not a block-diffusion model tandem knows)."""
    return next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)


def adapter_class(family: str) -> type:
    """The adapter class of ``family``; ValueError naming the known ones."""
    target = ADAPTERS.get(family)
    if target is None:
        raise ValueError(f"family: unknown model family {family!r}; known: {', '.join(sorted(ADAPTERS))}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def load_adapter(family: str, path: str, *args, **kwargs):
    """An adapter of ``family`` over the checkpoint at ``path`` (blocking: loads the weights)."""
    return adapter_class(family)(path, *args, **kwargs)
