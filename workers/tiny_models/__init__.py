"""tandem's built-in models, built on demand: random weights, real tokenizers, offline.

They generate nonsense. They exist so that the whole system (vLLM in a Ray actor, the diffusion
batcher, the gateway, the tests, the benchmarks) runs on any machine, offline. Everything is built
deterministically from a fixed seed. The builders, in one place: ``llama`` (``tiny-llama``, its
LoRA adapter ``tiny-llama-lora``, the embedding model ``tiny-embed``, and the shared tokenizer) and ``diffusiongemma``
(``tiny-diffusiongemma``, and ``shape-diffusiongemma``: DiffusionGemma's real canvas and
vocabulary on a tiny trunk). A model config names one as
``source: builtin:<name>``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from workers.tiny_models.diffusiongemma import (
    build_shape_diffusiongemma,
    build_shape_diffusiongemma_deep,
    build_tiny_diffusiongemma,
)
from workers.tiny_models.llama import build_tiny_embed, build_tiny_llama, build_tiny_llama_lora

logger = logging.getLogger(__name__)

DEFAULT_DIR = Path(__file__).resolve().parent.parent.parent / "models"
BUILD_VERSION = 2  # bump when the recipe changes, so stale builds are rebuilt (per model: VERSIONS)
TINY_LLAMA = "tiny-llama"
TINY_LLAMA_LORA = "tiny-llama-lora"  # a LoRA adapter of tiny-llama (PEFT's format)
TINY_EMBED = "tiny-embed"  # an embedding model (vLLM's pooling runner)
TINY_DIFFUSIONGEMMA = "tiny-diffusiongemma"
# DiffusionGemma's real canvas (256) and vocabulary (262,144) on a tiny trunk: ~170 MB, built in
# seconds; for benchmarks and tests/gpu (``diffusiongemma`` says why).
SHAPE_DIFFUSIONGEMMA = "shape-diffusiongemma"
# The same on a trunk of 8 layers 1,024 wide, where prompt work matters (the prefix-cache benchmark).
SHAPE_DIFFUSIONGEMMA_DEEP = "shape-diffusiongemma-deep"
BUILDERS = {TINY_LLAMA: build_tiny_llama, TINY_LLAMA_LORA: build_tiny_llama_lora, TINY_EMBED: build_tiny_embed,
            TINY_DIFFUSIONGEMMA: build_tiny_diffusiongemma,
            SHAPE_DIFFUSIONGEMMA: build_shape_diffusiongemma,
            SHAPE_DIFFUSIONGEMMA_DEEP: build_shape_diffusiongemma_deep}
# A model's own recipe version, so that a new or changed model does not rebuild the others.
# 4, 3: Gemma 4's chat format and markers (special tokens) in the tokenizer; <turn|> is the EOS.
VERSIONS = {TINY_LLAMA: BUILD_VERSION, TINY_LLAMA_LORA: 1, TINY_EMBED: 3, TINY_DIFFUSIONGEMMA: 4,
            SHAPE_DIFFUSIONGEMMA: 3, SHAPE_DIFFUSIONGEMMA_DEEP: 1}


# The libraries whose versions can change a build's bytes (the tokenizer is trained, the weights
# drawn and saved at build time): a build made with other versions is stale, as with another recipe.
SHAPING_LIBRARIES = ("tokenizers", "transformers", "torch", "safetensors")


def _stamp(path: Path) -> Path:
    return path / "tandem_build.json"


def build_version(name: str) -> dict:
    """What a build of ``name`` is made from: its recipe's version and the shaping libraries'."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(lib: str) -> str | None:
        try:
            return version(lib)
        except PackageNotFoundError:
            return None

    return {"version": VERSIONS.get(name, BUILD_VERSION),
            "libraries": {lib: installed(lib) for lib in SHAPING_LIBRARIES}}


def is_built(path: Path, name: str | None = None) -> bool:
    stamp = _stamp(path)
    if not stamp.exists():
        return False
    recorded = json.loads(stamp.read_text())
    wanted = build_version(name or path.name)
    return all(recorded.get(k) == v for k, v in wanted.items())


def build(name: str, root: Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Build one built-in model under ``root/name`` unless an up-to-date build is there."""
    if name not in BUILDERS:
        raise KeyError(f"unknown built-in model {name!r}; known: {sorted(BUILDERS)}")
    path = root / name
    if is_built(path, name) and not force:
        return path
    logger.info("building built-in model %s in %s", name, path)
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    BUILDERS[name](tmp)
    _stamp(tmp).write_text(json.dumps({"name": name, **build_version(name)}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    logger.info("built %s", path)
    return path


ON_DEMAND = (SHAPE_DIFFUSIONGEMMA_DEEP,)  # ~3.6 GB: built when a benchmark or config names it, never by build_all


def build_all(root: Path = DEFAULT_DIR, force: bool = False, only: list[str] | None = None) -> list[Path]:
    """Build every built-in model but the on-demand ones (or only the named ones) that is missing or stale."""
    return [build(name, root, force) for name in (only or [n for n in BUILDERS if n not in ON_DEMAND])]
