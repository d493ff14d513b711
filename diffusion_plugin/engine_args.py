"""A diffusion model's ``engine_args``: typed, with a description per field.

``gateway.config.parse_config`` validates them when the config loads (through
``workers.registry.validate_engine_args``), so a typo or a bad value is a ``ConfigError`` naming
the file and ``models.<i>.engine_args.<field>``; ``DiffusionEngine`` validates them again when it
is built directly (tests, benchmarks). No torch here: the gateway imports this module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diffusion_plugin.api.images import ImageLimits
from diffusion_plugin.batcher.memory import KV_FRACTION
from diffusion_plugin.families import ADAPTERS

_IMAGES = ImageLimits()


class DiffusionEngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str = Field("diffusiongemma", min_length=1, description="The model family: its adapter "
                        f"(diffusion_plugin/families/, one of: {', '.join(sorted(ADAPTERS))}).")
    max_batch: int = Field(16, ge=1, description="Sequences denoised together (rows of one decoder forward).")
    boundaries: Literal["block", "row"] = Field("block", description="block: sequences join and leave at block "
                                                "boundaries; row: each row commits and is replaced on its own.")
    sampler: Literal["exact", "fast"] = Field("exact", description="exact: bit-exact with HF generate() run alone; "
                                              "fast: batch-invariant and fused, not equal to generate().")
    prefix_cache: bool = Field(True, description="Fast sampler only: keep prompts' whole KV pages for reuse by "
                               "later prompts with the same prefix (and cache_salt), as vLLM's automatic prefix "
                               "caching; prompts are encoded in page-aligned chunks, so a hit changes no bit of an "
                               "answer. The exact sampler encodes a prompt in one pass, as generate(), and never "
                               "caches (this is then ignored).")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="The weights' torch dtype. None: the checkpoint's own on a cuda device (bfloat16 for "
        "DiffusionGemma), float32 on cpu.")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="Where the model runs: cpu, cuda or "
                        "cuda:<index>. In a config it follows the replica's resources.num_gpus (cuda when it holds a "
                        "GPU, with the fast sampler), and disagreeing with them fails at load.")
    num_threads: int | None = Field(None, ge=1, description="torch threads (set it to the replica's num_cpus). "
                                    "None: torch's default.")
    memory_budget_gib: float | None = Field(None, gt=0, description="GiB sequences may reserve (KV + per-row "
                                            "state); sequences beyond it wait. None: a safe fraction of the memory "
                                            "free once the weights are loaded, less a step's transient.")
    kv_cache_fraction: float | None = Field(None, gt=0, lt=1, description="Fast sampler on a cuda device (where "
                                            "the KV page pool is reserved at start): the share of the memory budget "
                                            "the pool takes; the rest covers the sequences' other bytes (state, "
                                            "activations, prompt pass). Larger: more KV pages (long sequences) at "
                                            "once, less room for the rest. Ignored on the host (pages are committed "
                                            f"as written) and by the exact sampler. None: {KV_FRACTION}.")
    compiled_vocab: bool | None = Field(None, description="Fast sampler: the vocabulary pass compiled "
                                        "(torch.compile, inductor; a few seconds at engine start; needs a C++ "
                                        "compiler on the host; a failure is logged and the eager passes serve). A "
                                        "row without a filter, grammar, top logprobs or pinned scores takes it "
                                        "blocked over the vocabulary (each 8,192 ids' logits kept in the cache, "
                                        "nothing vocabulary-sized written); a row with top logprobs or pinned "
                                        "scores, as one fused kernel over its whole logits; a row with a filter "
                                        "(top_k, top_p, min_p, allowed ids, logit_bias, min_tokens) or a grammar, "
                                        "the eager passes. On a cuda device (its device form) a plain row instead "
                                        "takes its chunk's pass as one compiled graph, and the step's draws and "
                                        "acceptance are compiled too (with compiled_trunk: a whole step is 56.5 / 55.5 "
                                        "ops a layer at the 2-layer shape model at 1 row / a chunk of 4, counted on "
                                        "the host by tandem_tools.bench.opcount; not yet on a device). None: "
                                        "on for cpu (0.57 against 0.87 CPU s a row-step at DiffusionGemma's shape, "
                                        "1.2x its two GEMMs), off on cuda (not measured there yet).")
    compiled_trunk: bool = Field(False, description="Fast sampler (ignored by the exact one): the decoder "
                                 "forward as torch.compile (inductor) graphs, one per size class (a lone row or "
                                 "several; context pages padded to a power of two; a block's first step or not), "
                                 "those of a one-page context compiled at engine start (a rehearsal of one "
                                 "row and of two), longer contexts' in the first step that needs them (4-35 s "
                                 "each on a CPU; the step waits). At DiffusionGemma's shape on a CPU the trunk "
                                 "takes ~34 kernels a layer and 0.8x the eager one's CPU, but a whole step no less "
                                 "(the vocabulary pass dominates there); tokens stay batch-invariant but differ "
                                 "from the eager trunk's (~5e-5 in the hidden states). Off by default until "
                                 "measured on a device.")
    enforce_eager: bool = Field(False, description="vLLM's `--enforce-eager`, meaning what it means there: no "
                                "compilation and no CUDA graphs (compiled_vocab, compiled_trunk and cuda_graphs off; "
                                "setting one of them on as well is a config error). The eager passes serve: the "
                                "same tokens as compiled_vocab (it is exact), none of its start-up compile time.")
    cuda_graphs: bool = Field(False, description="With compiled_trunk on a cuda device: the compiled trunk's "
                              "graphs captured as CUDA graphs (torch.compile's reduce-overhead mode), one per row "
                              "count and size class, and replayed (one launch for the trunk's ~34 kernels a "
                              "layer); the KV page pool is marked static, so a replay copies no KV. Needs "
                              "compiled_trunk, the fast sampler and a cuda device (else the config fails at load). "
                              "Not yet run on a device: off by default.")
    tool_call_parser: str | None = Field(None, min_length=1, description="vLLM's tool parser name (`gemma4` for "
                                         "DiffusionGemma): serves `tool_choice: \"auto\"` (the committed text is "
                                         "parsed into tool calls by vLLM's parser class), as `vllm serve "
                                         "--enable-auto-tool-choice --tool-call-parser`. None: `auto` with tools is "
                                         "a 400.")
    reasoning_parser: str | None = Field(None, min_length=1, description="vLLM's reasoning parser name (`gemma4` "
                                         "for DiffusionGemma): the model's thinking goes to the message's "
                                         "`reasoning` and to Responses reasoning items, as `vllm serve "
                                         "--reasoning-parser`.")
    max_images: int = Field(_IMAGES.max_images, ge=0, description="Images one request may carry.")
    max_image_bytes: int = Field(_IMAGES.max_image_bytes, ge=1, description="Largest encoded image, in bytes "
                                 "(beyond: 413).")
    max_image_pixels: int = Field(_IMAGES.max_pixels, ge=1, description="Most pixels of a decoded image "
                                  "(decompression bombs; beyond: 413).")
    image_fetch: bool = Field(_IMAGES.fetch_urls, description="Fetch http(s) image URLs from the replica "
                              "(false: only data: URLs are accepted).")
    image_fetch_timeout_s: float = Field(_IMAGES.fetch_timeout_s, gt=0, description="Seconds one image fetch "
                                         "may take.")

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if v not in ADAPTERS:
            raise ValueError(f"unknown model family {v!r}; known: {', '.join(sorted(ADAPTERS))}")
        return v

    @model_validator(mode="after")
    def _eager_compiles_nothing(self):
        on = [f for f in ("compiled_vocab", "compiled_trunk", "cuda_graphs") if getattr(self, f)]
        if self.enforce_eager and on:
            raise ValueError(f"enforce_eager: true compiles nothing, and {on[0]}: true asks for compilation; give one")
        return self

    @model_validator(mode="after")
    def _cuda_graphs_need_a_compiled_trunk_on_a_device(self):
        if self.cuda_graphs and (not self.use_compiled_trunk or self.device == "cpu"):
            raise ValueError("cuda_graphs needs compiled_trunk: true, sampler: fast and a cuda device (a replica "
                             f"with num_gpus); here compiled_trunk={self.compiled_trunk}, sampler={self.sampler}, "
                             f"device={self.device}")
        return self

    def image_limits(self) -> ImageLimits:
        return ImageLimits(max_images=self.max_images, max_image_bytes=self.max_image_bytes,
                           max_pixels=self.max_image_pixels, fetch_urls=self.image_fetch,
                           fetch_timeout_s=self.image_fetch_timeout_s)

    @property
    def load_dtype(self) -> str:
        """What the weights load as: the dtype given, else the checkpoint's ("auto") on a device,
        float32 on the host."""
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "auto"

    @property
    def use_compiled_vocab(self) -> bool:
        """``compiled_vocab`` resolved: fast sampler only, on by default on the host (off with
        ``enforce_eager``)."""
        if self.sampler != "fast" or self.enforce_eager:
            return False
        return self.compiled_vocab if self.compiled_vocab is not None else self.device == "cpu"

    @property
    def use_compiled_trunk(self) -> bool:
        return self.sampler == "fast" and self.compiled_trunk and not self.enforce_eager

    @property
    def row_boundaries(self) -> bool:
        return self.boundaries == "row"
