"""Build tandem's built-in tiny models: random weights, a real BPE tokenizer, a chat template.

They generate nonsense. They exist so that the whole system (vLLM in a Ray actor, the
gateway, the tests, the benchmarks) runs on any machine, offline. Everything is built
deterministically from a fixed seed and the corpus shipped in ``workers/data/``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "models"
TINY_LLAMA = "tiny-llama"
BUILD_VERSION = 2  # bump when the recipe changes, so stale builds are rebuilt (per model: VERSIONS)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 1024) -> int:
    """Train a byte-level BPE on the shipped corpus and save it as a HF fast tokenizer.

    Returns the tokenizer's length (the model's vocabulary size).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "</s>"],
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


def build_tiny_llama(out: Path, seed: int = 0) -> None:
    """A 2-layer Llama that vLLM's CPU backend accepts (head_dim 64)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = build_tokenizer(out)
    ids = {t: SPECIAL_TOKENS.index(t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        # Large random weights make the greedy choice far from ties, so outputs do not
        # flip with batch composition (parity tests compare engines token for token).
        initializer_range=0.5,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["<s>"], eos_token_id=[ids["<|im_end|>"], ids["</s>"]], pad_token_id=ids["<pad>"]
    ).save_pretrained(out)


def build_tiny_diffusiongemma(out: Path, seed: int = 0) -> None:
    from diffusion_plugin.tiny_model import build_tiny_diffusiongemma as build_dg

    build_dg(out, seed)


def build_shape_diffusiongemma(out: Path, seed: int = 0) -> None:
    from diffusion_plugin.tiny_model import build_shape_diffusiongemma as build_shape

    build_shape(out, seed)


TINY_DIFFUSIONGEMMA = "tiny-diffusiongemma"
# DiffusionGemma's real canvas (256) and vocabulary (262,144) on a tiny trunk: ~170 MB, built in
# seconds; for benchmarks and tests/gpu (diffusion_plugin/tiny_model.py says why).
SHAPE_DIFFUSIONGEMMA = "shape-diffusiongemma"
BUILDERS = {TINY_LLAMA: build_tiny_llama, TINY_DIFFUSIONGEMMA: build_tiny_diffusiongemma,
            SHAPE_DIFFUSIONGEMMA: build_shape_diffusiongemma}
# A model's own recipe version, so that a new or changed model does not rebuild the others.
VERSIONS = {TINY_LLAMA: BUILD_VERSION, TINY_DIFFUSIONGEMMA: BUILD_VERSION, SHAPE_DIFFUSIONGEMMA: 1}


def _stamp(path: Path) -> Path:
    return path / "tandem_build.json"


def is_built(path: Path, name: str | None = None) -> bool:
    stamp = _stamp(path)
    version = VERSIONS.get(name or path.name, BUILD_VERSION)
    return stamp.exists() and json.loads(stamp.read_text()).get("version") == version


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
    _stamp(tmp).write_text(json.dumps({"name": name, "version": VERSIONS[name]}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    logger.info("built %s", path)
    return path


def build_all(root: Path = DEFAULT_DIR, force: bool = False, only: list[str] | None = None) -> list[Path]:
    """Build every built-in model (or only the named ones) that is missing or stale."""
    return [build(name, root, force) for name in (only or BUILDERS)]
