"""The shape model (`shape-diffusiongemma`): DiffusionGemma's real canvas, vocabulary and
attention layout on a tiny trunk. Built once (~3 s), one encoder pass and one decoder forward."""

import json

import pytest
import torch

from workers import tiny_models
from workers.tiny_models import diffusiongemma as tiny_model


@pytest.fixture(scope="module")
def path():
    return tiny_models.build(tiny_models.SHAPE_DIFFUSIONGEMMA)


def test_config_has_the_real_shape(path):
    cfg = json.loads((path / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["canvas_length"] == 256 and text["vocab_size"] == 262_144
    assert text["layer_types"] == ["sliding_attention", "full_attention"]  # the last layer is full, as released
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (16, 8, 256)
    assert text["per_layer_config"] == {"1": {"head_dim": 512, "num_key_value_heads": 2}}  # full layers
    assert (text["sliding_window"], text["num_experts"], text["top_k_experts"]) == (1024, 128, 8)
    assert cfg["tie_word_embeddings"] and text["tie_word_embeddings"]
    # Every id the model treats specially is a tokenizer id (sampled ids >= 1039 decode to nothing).
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tok_len = len(tokenizer["model"]["vocab"]) + len(tiny_model.EXTRA_SPECIAL_TOKENS + tiny_model.GEMMA4_TOKENS)
    assert max(t["id"] for t in tokenizer["added_tokens"]) == tok_len - 1
    for key in ("boi_token_id", "eoi_token_id", "image_token_id"):
        assert cfg[key] < tok_len
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        assert text[key] < tok_len
    assert json.loads((path / "tandem_build.json").read_text())["version"] == tiny_models.VERSIONS["shape-diffusiongemma"]
    assert tiny_models.is_built(path)


def test_a_build_made_with_other_library_versions_is_stale(tmp_path):
    """The tokenizer is trained and the weights drawn at build time: other tokenizers, transformers,
    torch or safetensors versions can change a build's bytes, so it is rebuilt."""
    stamp = tmp_path / "tandem_build.json"
    now = tiny_models.build_version(tiny_models.TINY_LLAMA)
    assert set(now["libraries"]) == {"tokenizers", "transformers", "torch", "safetensors"}
    assert all(now["libraries"].values())
    stamp.write_text(json.dumps({"name": "tiny-llama", **now}))
    assert tiny_models.is_built(tmp_path, tiny_models.TINY_LLAMA)
    stamp.write_text(json.dumps({"name": "tiny-llama", **now, "libraries": {**now["libraries"], "tokenizers": "0.1"}}))
    assert not tiny_models.is_built(tmp_path, tiny_models.TINY_LLAMA)
    stamp.write_text(json.dumps({"name": "tiny-llama", "version": now["version"]}))  # a stamp from before
    assert not tiny_models.is_built(tmp_path, tiny_models.TINY_LLAMA)


def test_loads_and_runs_one_step(path):
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion, DynamicCache

    torch.set_num_threads(1)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()  # tied
    layers = model.model.decoder.layers
    assert layers[0].self_attn.v_proj is not None and layers[1].self_attn.v_proj is None  # K=V on full layers
    assert layers[1].self_attn.head_dim == 512 and layers[1].self_attn.k_proj.out_features == 2 * 512
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)])
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        model.model.encoder(input_ids=ids, past_key_values=cache)
        canvas = torch.randint(0, tiny_model.SHAPE_VOCAB_SIZE, (1, 256), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(ids.shape[1], ids.shape[1] + 256, dtype=torch.int32).unsqueeze(0)
        logits = model(decoder_input_ids=canvas, past_key_values=cache, decoder_position_ids=positions).logits
    assert logits.shape == (1, 256, 262_144) and logits.dtype == torch.float32
    assert float(logits.abs().max()) <= 30.0  # final_logit_softcapping
    assert cache.get_seq_length() == ids.shape[1]  # the decoder reads the cache, never writes it
