"""``tiny-llama`` (random weights, a real BPE tokenizer, a chat template) and the tokenizer every
built-in model shares, trained deterministically on the corpus shipped in ``workers/data/``."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"

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
