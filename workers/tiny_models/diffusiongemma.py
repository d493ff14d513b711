"""A tiny random DiffusionGemma (``DiffusionGemmaForBlockDiffusion``) for tests and benchmarks.

Why: the released checkpoint is 26B parameters; the block-diffusion batcher needs a model that
exercises the same code paths (encoder prefill and commit passes into a hybrid sliding/full
``DynamicCache``, bidirectional decoder passes over [cache | canvas], self-conditioning, the MoE
block, the entropy-bound sampler) on any CPU, offline, in seconds. It generates nonsense.

Deterministic: the tokenizer is trained on the corpus in ``workers/data``, the weights are drawn
after ``torch.manual_seed(seed)`` (in a forked RNG; the caller's stream is left alone). float32,
so per-row re-implementations can be compared bit for bit with ``generate()``.

Vocabulary: ``build_tokenizer`` yields 1024 ids. DiffusionGemma's config also carries
``boi_token_id`` / ``eoi_token_id`` / ``image_token_id`` (defaults ~256k, outside a tiny vocab;
``generate()`` compares the prompt against ``image_token_id``). Rather than alias them onto BPE
ids, three extra special tokens are appended to the tokenizer (ids 1024, 1025, 1026) and the
model's vocab_size is the tokenizer's new length, 1027, so every id the sampler can draw
(canvas init and renoise draw uniformly over the whole vocab) decodes.

Weights: ``initializer_range`` 0.2 (not 0.02, where every distribution is near uniform), and the
self-conditioning MLP's ``down_proj`` scaled by 0.1 after init (at full scale the random
self-conditioning signal swamps the canvas embeddings and the argmax canvas never settles). Then
at default settings ~12 tokens are accepted per step and blocks run all 48 steps, while at
near-greedy temperatures (t_min=0.01, t_max=0.02) blocks stop early on the stable-and-confident
rule after a few steps; outputs still depend on the prompt. Tests need both paths.

``build_shape_diffusiongemma`` builds ``shape-diffusiongemma`` with the same recipe at the released
model's canvas (256), vocabulary (262,144) and attention/MoE layout: what a diffusion step costs
at the real shape, on a trunk small enough for a CPU.
"""

from __future__ import annotations

from pathlib import Path

from workers.tiny_models.llama import SPECIAL_TOKENS, build_tokenizer

EXTRA_SPECIAL_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# Gemma 4's chat and tool-calling markers (ids 1027...), special tokens as in Gemma 4's tokenizer:
# vLLM's ``gemma4`` tool and reasoning parsers find a tool call, a thinking channel and a turn's
# end by them. ``<turn|>`` ends a model turn: it is the model's EOS.
GEMMA4_TOKENS = ["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                 "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>"]
END_OF_TURN = "<turn|>"
PATCH_SIZE, POOLING_KERNEL, MAX_SOFT_TOKENS = 4, 2, 70
# Gemma 4's chat format, written for the tiny models (not a copy of Gemma's template):
# - turns ``<|turn>role\n...<turn|>\n``, the assistant's role being ``model``;
# - a system turn when there is a system (or developer) message, tools or thinking: ``<|think|>``
#   first when ``enable_thinking`` (chat_template_kwargs), then the system text, then one
#   ``<|tool>declaration:name{description:<|"|>...<|"|>,parameters:{...}}<tool|>`` per tool;
# - an assistant's tool calls ``<|tool_call>call:name{key:value,...}<tool_call|>`` (strings
#   between ``<|"|>``; arguments given as a JSON string are written as given), each tool result
#   ``<|tool_response>response:name{value:<|"|>...<|"|>}<tool_response|>`` in the same model turn,
#   which the model then continues (no new generation prompt after a tool result);
# - image parts: the image placeholder the processor expands.
CHAT_TEMPLATE_WITH_IMAGES = (
    "{%- macro arg(v) -%}"
    "{%- if v is string -%}{{ '<|\"|>' + v + '<|\"|>' }}"
    "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
    "{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | dictsort -%}{{ k }}:{{ arg(x) }}"
    "{%- if not loop.last %},{% endif -%}{%- endfor -%}{{ '}' }}"
    "{%- elif v is sequence -%}{{ '[' }}{%- for x in v -%}{{ arg(x) }}{%- if not loop.last %},{% endif -%}"
    "{%- endfor -%}{{ ']' }}"
    "{%- elif v is none -%}{{ 'null' }}{%- else -%}{{ v }}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- elif part['type'] == 'image' -%}{{ '<image_soft_token>' }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(rest=messages, open=false) -%}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- set has_system = messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- if has_system or tools or thinking -%}"
    "{{ '<|turn>system\n' }}{%- if thinking -%}{{ '<|think|>\n' }}{%- endif -%}"
    "{%- if has_system -%}{{ text(messages[0]['content']) }}{%- set ns.rest = messages[1:] -%}{%- endif -%}"
    "{%- for tool in tools or [] -%}{%- set f = tool['function'] if tool['function'] is defined else tool -%}"
    "{{ '<|tool>declaration:' + f['name'] + '{description:' + arg(f['description'] or '') }}"
    "{%- if f['parameters'] -%}{{ ',parameters:' + arg(f['parameters']) }}{%- endif -%}{{ '}<tool|>' }}"
    "{%- endfor -%}{{ '<turn|>\n' }}"
    "{%- endif -%}"
    "{%- for message in ns.rest -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- set called = namespace(name=message['name'] or 'tool') -%}"
    "{%- for m in messages -%}{%- for c in m['tool_calls'] or [] -%}"
    "{%- if c['id'] is defined and c['id'] == message['tool_call_id'] -%}"
    "{%- set called.name = c['function']['name'] -%}"
    "{%- endif -%}{%- endfor -%}{%- endfor -%}"
    "{{ '<|tool_response>response:' + called.name + '{value:' + arg(text(message['content'])) }}"
    "{{ '}<tool_response|>' }}"
    "{%- else -%}"
    "{%- if ns.open -%}{%- if message['role'] != 'assistant' -%}{{ '<turn|>\n' }}{%- set ns.open = false -%}"
    "{%- endif -%}{%- endif -%}"
    "{%- if not ns.open -%}{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- endif -%}"
    "{{ text(message['content']) }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{ '<|tool_call>call:' + call['function']['name'] }}"
    "{%- set a = call['function']['arguments'] -%}"
    "{%- if a is string -%}{{ '{' + a + '}' if not a.startswith('{') else a }}"
    "{%- else -%}{{ arg(a or {}) }}{%- endif -%}"
    "{{ '<tool_call|>' }}"
    "{%- endfor -%}"
    "{%- if message['tool_calls'] -%}{%- set ns.open = true -%}{%- else -%}{{ '<turn|>\n' }}"
    "{%- set ns.open = false -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.open -%}{%- if not add_generation_prompt -%}{{ '<turn|>\n' }}{%- endif -%}"
    "{%- elif add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}"
)
CANVAS_LENGTH = 32
INITIALIZER_RANGE = 0.2
SELF_CONDITIONING_SCALE = 0.1


# The shape model: DiffusionGemma's real canvas, vocabulary and attention layout on a tiny trunk.
SHAPE_CANVAS_LENGTH = 256  # DiffusionGemmaConfig.canvas_length's default (the released model's)
SHAPE_VOCAB_SIZE = 262_144  # DiffusionGemmaTextConfig.vocab_size's default (Gemma's vocabulary)
# Attention and MoE layout of google/diffusiongemma-26B-A4B-it (a Gemma 4 26B-A4B trunk). Read off
# transformers 5.19's DiffusionGemmaTextConfig (head_dim 256, global_head_dim 512, the 5:1
# sliding/full pattern ending on a full layer, final_logit_softcapping 30, tied embeddings, K=V
# on full layers: they have no v_proj) and the 26B-A4B notes there (num_global_key_value_heads 2),
# plus the published Gemma 4 26B-A4B layout where transformers has no default: 16 query heads,
# 8 KV heads on sliding layers, a 1024-token sliding window, 128 experts with top-8 routing.
SHAPE_ATTENTION = {
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "sliding_window": 1024,
    "num_experts": 128,
    "top_k_experts": 8,
}


def build_tiny_diffusiongemma(out: Path, seed: int = 0) -> None:
    """Build a ~0.7M-parameter random DiffusionGemma into ``out`` (weights, tokenizer, generation config)."""
    _build(out, seed, canvas_length=CANVAS_LENGTH, vocab_size=None, text={
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "global_head_dim": 64,
        "sliding_window": 64, "max_position_embeddings": 4096, "num_experts": 4, "top_k_experts": 2})


def build_shape_diffusiongemma(out: Path, seed: int = 0) -> None:
    """Build ``shape-diffusiongemma``: canvas 256, vocabulary 262,144 and the released attention/MoE
    layout (``SHAPE_ATTENTION``) on a trunk 128 wide and 2 layers deep (one sliding, one full).

    Why: every vocab-sized cost of a step (lm_head, softcap, sampler, random draws, the
    self-conditioning input) and every canvas-sized one is that of the real model, while the trunk,
    which a GPU makes cheap, stays tiny; so it measures what batching a diffusion step costs at
    the real shape on any CPU. ~40M parameters, ~170 MB float32 (the 262,144 x 128 embedding is 134
    MB, tied to the lm_head and shared by encoder and decoder, as in the released model).

    Tokenizer: the tiny BPE (1,027 ids, the same special tokens and image tokens as the tiny
    model), while ``vocab_size`` is 262,144: every id the model and sampler use (pad, bos, eos,
    image tokens) is inside the tokenizer; sampled ids >= 1,027 have no text and decode to nothing
    (the token counts, which the benchmarks use, are unaffected). A tokenizer with 262,144 real
    entries would cost a ~10 MB tokenizer.json and seconds per load for no benefit here.
    """
    _build(out, seed, canvas_length=SHAPE_CANVAS_LENGTH, vocab_size=SHAPE_VOCAB_SIZE, text=SHAPE_ATTENTION)


# The trunk of the tiny and shape models (2 layers, 128 wide).
TINY_TRUNK = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "layer_types": ["sliding_attention", "full_attention"], "moe_intermediate_size": 64}
# ``shape-diffusiongemma-deep``: 8 layers (Gemma 4's pattern: sliding, then a full one) 1,024 wide,
# heavy enough for prompt work to matter (the prefix-cache benchmark), ~0.9B parameters float32.
DEEP_TRUNK = {"hidden_size": 1024, "intermediate_size": 1024, "num_hidden_layers": 8,
              "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
              + ["full_attention"], "moe_intermediate_size": 32}


def build_shape_diffusiongemma_deep(out: Path, seed: int = 0) -> None:
    """Build ``shape-diffusiongemma-deep``: ``shape-diffusiongemma``'s canvas, vocabulary and
    attention/MoE layout on a trunk of 8 layers 1,024 wide (``DEEP_TRUNK``), where a long prompt's
    encoder pass costs seconds on a CPU (the prefix cache's benchmark)."""
    _build(out, seed, canvas_length=SHAPE_CANVAS_LENGTH, vocab_size=SHAPE_VOCAB_SIZE, text=SHAPE_ATTENTION,
           trunk=DEEP_TRUNK)


def _build(out: Path, seed: int, canvas_length: int, vocab_size: int | None, text: dict,
           trunk: dict = TINY_TRUNK) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        DiffusionGemmaConfig,
        DiffusionGemmaForBlockDiffusion,
        DiffusionGemmaTextConfig,
        Gemma4VisionConfig,
    )
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil


    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base_len = build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"extra_special_tokens": EXTRA_SPECIAL_TOKENS + GEMMA4_TOKENS},
                           replace_extra_special_tokens=False)
    tok.eos_token = END_OF_TURN
    tok.chat_template = CHAT_TEMPLATE_WITH_IMAGES
    tok.save_pretrained(out)
    Gemma4ImageProcessorPil(patch_size=PATCH_SIZE, max_soft_tokens=MAX_SOFT_TOKENS,
                            pooling_kernel_size=POOLING_KERNEL).save_pretrained(out)
    vocab = vocab_size or len(tok)
    assert vocab >= len(tok), (vocab, len(tok))
    boi, eoi, image = tok.convert_tokens_to_ids(EXTRA_SPECIAL_TOKENS)
    assert (boi, eoi, image) == (base_len, base_len + 1, base_len + 2), (boi, eoi, image, base_len)
    ids = {t: SPECIAL_TOKENS.index(t) for t in SPECIAL_TOKENS}
    eos = tok.convert_tokens_to_ids(END_OF_TURN)
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))

    text_config = DiffusionGemmaTextConfig(
        vocab_size=vocab,
        **trunk,
        initializer_range=INITIALIZER_RANGE,
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<s>"],
        eos_token_id=eos,
        use_bidirectional_attention="vision",  # as the larger Gemma 4 models: images attend within themselves
        **text,
    )
    # A tiny vision tower with the processor's geometry: 4-px patches pooled 2x2, at most 70 soft
    # tokens per image (280 patches, up to 140 patches on a side, hence the position table).
    vision_config = Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, patch_size=PATCH_SIZE, pooling_kernel_size=POOLING_KERNEL,
        position_embedding_size=160,
    )
    config = DiffusionGemmaConfig(
        text_config=text_config,
        vision_config=vision_config,
        boi_token_id=boi,
        eoi_token_id=eoi,
        image_token_id=image,
        canvas_length=canvas_length,
        initializer_range=INITIALIZER_RANGE,
        dtype="float32",
    )
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config).to(torch.float32).eval()
        model.model.decoder.self_conditioning.down_proj.weight.mul_(SELF_CONDITIONING_SCALE)
    # The defaults generate() would apply anyway, written out so the checkpoint is self-describing.
    model.generation_config = DiffusionGemmaGenerationConfig(
        max_new_tokens=256,
        max_denoising_steps=48,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
        t_min=0.4,
        t_max=0.8,
        stability_threshold=1,
        confidence_threshold=0.005,
        bos_token_id=ids["<s>"],
        eos_token_id=eos,
        pad_token_id=ids["<pad>"],
    )
    model.save_pretrained(out, safe_serialization=True)
