"""``tiny-llama`` (random weights, a real BPE tokenizer, a chat template) and the tokenizer every
built-in model shares, trained deterministically on the corpus shipped in ``workers/data/``."""

from __future__ import annotations

import json
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


# tiny-llama's linear layers (module name -> (in, out)), the targets of its built-in LoRA adapter.
LLAMA_LINEARS = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (128, 64), "self_attn.v_proj": (128, 64),
                 "self_attn.o_proj": (128, 128), "mlp.gate_proj": (128, 256), "mlp.up_proj": (128, 256),
                 "mlp.down_proj": (256, 128)}
LORA_RANK, LORA_ALPHA = 8, 16


def build_tiny_llama_lora(out: Path, seed: int = 1) -> None:
    """A random, deterministic LoRA adapter for ``tiny-llama`` in PEFT's format (what
    ``vllm serve --lora-modules`` and ``/v1/load_lora_adapter`` read): rank 8 on every linear
    layer of both decoder layers, large enough that its greedy answers differ from the base's."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for name, (fan_in, fan_out) in LLAMA_LINEARS.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(LORA_RANK, fan_in, generator=gen) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, LORA_RANK, generator=gen) * 0.5
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": LORA_ALPHA,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
              "target_modules": sorted({n.split(".")[-1] for n in LLAMA_LINEARS}),
              "base_model_name_or_path": "tiny-llama", "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def build_tiny_embed(out: Path, seed: int = 2) -> None:
    """``tiny-embed``: tiny-llama's shape as a ``LlamaModel`` (no LM head), which vLLM serves as an
    embedding model (its pooling runner; the shared tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaModel

    vocab = build_tokenizer(out)
    ids = {t: SPECIAL_TOKENS.index(t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                         initializer_range=0.5, bos_token_id=ids["<s>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<pad>"], dtype="float32")
    config.architectures = ["LlamaModel"]
    config.is_matryoshka = True  # `dimensions` truncates its vectors (vLLM reads this from the config)
    torch.manual_seed(seed)
    # vLLM loads a LlamaModel checkpoint into its LlamaForCausalLM (pooling runner): the weights under
    # ``model.`` as a causal LM's (``save_pretrained`` of a bare LlamaModel writes them without it).
    weights = {f"model.{k}": v.contiguous() for k, v in LlamaModel(config).state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
