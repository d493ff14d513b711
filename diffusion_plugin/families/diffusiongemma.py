"""What is DiffusionGemma's own: loading, the encoder and decoder calls, self-conditioning,
the entropy-bound sampler and its stopping rule, the generation-config defaults.

The vocab-wide part of a step (lm_head, softcap, sampler) is in ``diffusiongemma_vocab``.
Every numeric step copies transformers' ``generation_diffusion_gemma.py`` (5.19) expression by
expression, so a sequence reproduces ``generate()`` run alone bit for bit in float32
(see ``diffusion_plugin/NOTES_generate.md``). Random draws use each sequence's own generator
in the reference's order: canvas init per block; per step the multinomial, then the renoise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_plugin.batcher.memory import MemoryShape
from diffusion_plugin.families import diffusiongemma_moe as moe
from diffusion_plugin.families import diffusiongemma_vocab as vocab
from diffusion_plugin.step import gemm, kv_view
from diffusion_plugin.step.attention import ATTN_NAME, ENCODE, EncodeCacheView, EncodeSpec, register
from diffusion_plugin.step.local_var import LocalVar

# The self-conditioning soft embeddings of the current decoder forward (see decode_hidden).
SOFT: LocalVar[torch.Tensor | None] = LocalVar("tandem_soft", None)

FAMILY = "diffusiongemma"


@dataclass
class ImageEmbeds:
    """One request's images, encoded: what its prompt pass scatters into its placeholders."""

    features: torch.Tensor  # the vision tower's soft tokens, all images in order
    num_soft_tokens: list[int]  # per image
    pixel_values: torch.Tensor  # kept for parity checks against generate()
    image_position_ids: torch.Tensor


def _image_processor(path: str):
    """The checkpoint's image processor; the PIL backend where torchvision is missing (the CPU
    wheels here), else what AutoImageProcessor picks. None without a preprocessor config."""
    from pathlib import Path

    if Path(path).is_dir() and not (Path(path) / "preprocessor_config.json").exists():
        return None
    try:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path)
    except (ImportError, ValueError, OSError):
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        return Gemma4ImageProcessorPil.from_pretrained(path)


def _soft_embeddings(module, args):
    """Called with the decoder's ``(inputs_embeds, soft_embeddings)``; the decoder got no logits
    (so its soft embeddings are zeros): substitute ours, computed right after the last step with
    the decoder's own expression on the same shapes (see ``diffusiongemma_vocab``)."""
    soft = SOFT.get()
    return None if soft is None else (args[0], soft)


class DiffusionGemmaAdapter:
    """DiffusionGemma as a ``diffusion_plugin.family.Family``."""

    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu", num_threads: int | None = None):
        from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

        if num_threads:
            torch.set_num_threads(int(num_threads))
        register()
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(
            path, dtype="auto" if dtype == "auto" else getattr(torch, dtype))  # auto: the checkpoint's
        self.model = model.to(device).eval()
        self.model.set_attn_implementation(ATTN_NAME)
        self.model.model.decoder.self_conditioning.register_forward_pre_hook(_soft_embeddings)
        moe.install(self.model)  # batch-invariant tiled experts in fast mode (HF's in exact mode)
        gemm.install(self.model, skip=(self.model.get_output_embeddings(),))  # batched linears (fast mode)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        cfg = self.model.config
        self.device = torch.device(device)
        self.canvas_length = cfg.canvas_length
        self.vocab_size = cfg.text_config.vocab_size
        self.layer_types = list(cfg.text_config.layer_types)
        self.sliding_window = cfg.text_config.sliding_window
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos])
        self.max_position = getattr(cfg.text_config, "max_position_embeddings", None)
        # Vision input: the checkpoint's own image processor (preprocessor_config.json) and tokens.
        self.image_processor = _image_processor(path) if getattr(cfg, "vision_config", None) is not None else None
        self.image_token_id = getattr(cfg, "image_token_id", None)
        self.boi_token_id, self.eoi_token_id = getattr(cfg, "boi_token_id", None), getattr(cfg, "eoi_token_id", None)
        # Larger Gemma 4 models attend bidirectionally within each image in the prompt pass.
        self.vision_blocks = getattr(cfg.text_config, "use_bidirectional_attention", None) == "vision"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def has_vision(self) -> bool:
        return self.image_processor is not None and self.image_token_id is not None

    def defaults(self) -> dict:
        """The model's generation-config defaults for the per-request knobs."""
        gen = self.model.generation_config
        sampler = getattr(gen, "sampler_config", None)
        bound = getattr(sampler, "entropy_bound", None) if sampler is not None else None
        return {
            "max_denoising_steps": getattr(gen, "max_denoising_steps", None) or 48,
            "entropy_bound": bound if bound is not None else 0.1,
            "t_min": getattr(gen, "t_min", None) if getattr(gen, "t_min", None) is not None else 0.4,
            "t_max": getattr(gen, "t_max", None) if getattr(gen, "t_max", None) is not None else 0.8,
            "stability_threshold": getattr(gen, "stability_threshold", None)
            if getattr(gen, "stability_threshold", None) is not None else 1,
            "confidence_threshold": getattr(gen, "confidence_threshold", None)
            if getattr(gen, "confidence_threshold", None) is not None else 0.005,
        }

    def new_cache(self, pool=None):
        """A sequence's KV cache: HF's ``DynamicCache`` (exact mode), or the same with its layers
        paged in ``pool`` (fast mode, ``kv_view``)."""
        from transformers import DynamicCache

        config = self.model.config.get_text_config(decoder=True)
        return DynamicCache(config=config) if pool is None else kv_view.paged_cache(config, pool)

    def kv_layout(self) -> list[tuple[int, int]]:
        """Per layer: (kv heads, head dim) of what its cache holds (the fast mode's page pools)."""
        out = []
        for layer in self.model.model.decoder.layers:
            attn = layer.self_attn
            out.append((attn.k_proj.out_features // attn.head_dim, attn.head_dim))
        return out

    # -- images -----------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, images: list) -> ImageEmbeds:
        """One request's images through the processor and the vision tower, as the encoder's own
        prompt pass would (``get_image_features``). Called off the denoise loop, per request."""
        inputs = self.image_processor(images=images, return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(self.device, self.model.dtype)
        positions = inputs["image_position_ids"].to(self.device)
        features = self.model.model.encoder.get_image_features(pixel_values, positions, return_dict=True).pooler_output
        return ImageEmbeds(features=features, num_soft_tokens=[int(n) for n in inputs["num_soft_tokens_per_image"]],
                           pixel_values=pixel_values, image_position_ids=positions)

    def expand_image_tokens(self, ids: list[int], num_soft_tokens: list[int]) -> list[int]:
        """Each image placeholder of the templated prompt becomes ``boi, image x n, eoi`` (what
        the model's processor does to the text). Raises ValueError on a count mismatch."""
        out, k = [], 0
        for t in ids:
            if t != self.image_token_id:
                out.append(t)
                continue
            if k >= len(num_soft_tokens):
                raise ValueError(f"the prompt holds more image placeholders than the {len(num_soft_tokens)} images")
            out += [self.boi_token_id, *[self.image_token_id] * num_soft_tokens[k], self.eoi_token_id]
            k += 1
        if k != len(num_soft_tokens):
            raise ValueError(f"{len(num_soft_tokens)} images but {k} image placeholders after the chat template")
        return out

    # -- model calls ------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, caches: list, token_ids: list[torch.Tensor], starts: list[int],
               images: list[ImageEmbeds | None] | None = None) -> None:
        """One batched causal encoder pass (prefills and commits of several sequences); each
        row's K/V go to its own cache, with the mask that row would get alone. A prefill row with
        ``images`` gets its own image features at its own placeholders (and, for models that
        attend within images bidirectionally, its own image blocks in its mask)."""
        cfg = self.model.config
        encoder = self.model.model.encoder
        embed = encoder.get_input_embeddings()
        images = images or [None] * len(caches)
        lengths = [t.shape[1] for t in token_ids]
        longest = max(lengths)
        masks, embeds, positions = [], [], []
        pad = self.tokenizer.pad_token_id or 0
        for cache, toks, start, image in zip(caches, token_ids, starts, images, strict=True):
            n = toks.shape[1]
            pos = torch.arange(start, start + n, dtype=torch.int32, device=self.device).unsqueeze(0)
            mm_types = (toks == self.image_token_id).long() if image is not None and self.vision_blocks else None
            masks.append(encoder.create_masks_for_generate(
                config=cfg, inputs_embeds=torch.empty((1, n, 0), dtype=self.model.dtype, device=self.device),
                attention_mask=torch.ones((1, start + n), dtype=torch.bool, device=self.device),
                past_key_values=cache, position_ids=pos, mm_token_type_ids=mm_types))
            ids = torch.nn.functional.pad(toks, (longest - n, 0), value=pad)
            row = embed(ids)  # what the encoder does with input_ids, row by row (a lookup: same values)
            if image is not None:
                where = (ids == self.image_token_id).unsqueeze(-1)
                row = row.masked_scatter(where, image.features.to(row.device, row.dtype))
            embeds.append(row)
            positions.append(torch.nn.functional.pad(pos, (longest - n, 0), value=0))
        spec = EncodeSpec(caches, lengths, masks)
        token = ENCODE.set(spec)
        try:
            placeholder = {t: None for t in set(self.layer_types)}  # real masks are per row, in the spec
            encoder(inputs_embeds=torch.cat(embeds), attention_mask=placeholder, past_key_values=EncodeCacheView(spec),
                    position_ids=torch.cat(positions))
        finally:
            ENCODE.reset(token)

    @torch.no_grad()
    def decode_hidden(self, canvas: torch.Tensor, view, positions: torch.Tensor,
                      soft: torch.Tensor | None) -> torch.Tensor:
        """One batched bidirectional decoder forward over [cache | canvas]; returns the (B, C, H)
        hidden states (the vocab-wide head runs later, a few rows at a time). ``soft`` is each
        row's self-conditioning soft embedding (zeros on a block's first step), fed to the
        self-conditioning MLP in place of the one the decoder would compute from logits."""
        nones = {t: None for t in set(self.layer_types)}  # rows are masked by our attention
        token = SOFT.set(soft)
        try:
            return self.model.model.decoder(decoder_input_ids=canvas, past_key_values=view,
                                            decoder_attention_mask=nones,
                                            decoder_position_ids=positions).last_hidden_state
        finally:
            SOFT.reset(token)

    def memory_shape(self) -> MemoryShape:
        """What the scheduler needs to reserve memory per sequence (no torch there)."""
        text = self.model.config.get_text_config(decoder=True)
        layers = []
        for i, kind in enumerate(self.layer_types):
            attn = self.model.model.decoder.layers[i].self_attn
            kv_heads = attn.k_proj.out_features // attn.head_dim
            # Full layers without v_proj still cache values (K-derived): both count.
            layers.append((kv_heads * attn.head_dim, self.sliding_window - 1 if kind == "sliding_attention" else None))
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        return MemoryShape(canvas_length=self.canvas_length, vocab_size=self.vocab_size,
                           hidden_size=text.hidden_size, itemsize=itemsize, layers=tuple(layers),
                           num_heads=text.num_attention_heads)

    # -- the sampler (as in generation_diffusion_gemma.py) -------------------------------
    def init_canvas(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(low=0, high=self.vocab_size, size=(1, self.canvas_length), generator=generator,
                             device=self.device)

    def fast_experts(self, on: bool):
        """A context in which the MoE layers run fast mode's grouped experts (``on``) or HF's."""
        return moe.fast_experts(on)

    def vocab_scratch(self, compiled: bool = False, batched: bool = False):
        """Fast mode's reusable vocabulary buffers (``compiled``: its compiled passes, in a
        device's form if ``batched``: ``diffusiongemma_vocab.Scratch``)."""
        return vocab.Scratch(compiled, batched)

    def warm_vocab(self, scratch) -> None:
        scratch.warm(self.model, self.canvas_length, self.device)

    def vocab_fast(self, hidden: torch.Tensor, *args, **kwargs):
        """Fast mode's vocabulary pass over a chunk of rows (``diffusiongemma_vocab.fast_chunk``)."""
        return vocab.fast_chunk(self.model, hidden, *args, **kwargs)

    def read_scores(self, hidden: torch.Tensor, tokens: list[int]) -> list:
        return vocab.read_scores(self.model, hidden, tokens)

    def vocab_exact(self, hidden: torch.Tensor, p, steps_left: int, generator: torch.Generator, produced: int,
                    pins=None, grammar=None):
        """Exact mode's vocabulary pass for one row, HF's (``exact_row``; under a grammar, which
        no pinned row has: ``exact_row_constrained``)."""
        if grammar is None:
            return vocab.exact_row(self.model, hidden, p, steps_left, generator, produced, pins)
        return vocab.exact_row_constrained(self.model, hidden, p, steps_left, generator, grammar, produced)
