"""Validation of a diffusion request's body: OpenAI fields plus the ``diffusion`` extension.

Every field of a request is either honoured or refused with a 400 in the OpenAI envelope whose
``param`` names it (``diffusion.entropy_bound``, ``top_p``...). A field is never silently ignored.

Honoured (chat, completions; Responses in ``diffusion_plugin.api.responses``):
- ``model``, ``messages`` (chat; text and image parts), ``prompt`` (completions: a string, a list
  of strings, token ids or a list of token-id lists, as vLLM; prompt p's choice i is choice
  ``p * n + i``, and ``usage.prompt_tokens`` counts each prompt once, whatever ``n``),
  ``max_tokens``, ``max_completion_tokens`` (chat), ``temperature`` (0..2; the end of the
  model's temperature schedule, 0 is near-greedy), ``seed``, ``stop`` (up to 4 strings), ``n``
  (1..16), ``stream``, ``stream_options`` (``include_usage``, vLLM's ``continuous_usage_stats``: usage in every
  chunk), ``diffusion`` (the knobs below);
- ``ignore_eos`` (vLLM's): blocks go on past EOS until ``max_tokens`` (or a stop string), an
  EOS committed meanwhile being an ordinary token of the output (the text skips it, as vLLM's);
  vLLM's ``stop_token_ids`` (end a choice as EOS does, ``ignore_eos`` or not),
  ``include_stop_str_in_output`` and ``skip_special_tokens``;
- ``logprobs``/``top_logprobs`` (chat: bool and 0..20) and ``logprobs`` (completions: 0..20).
  The log-probability of a committed token is its log-softmax under the temperature-scaled
  distribution of the denoise step that committed its block (its last step: a block commits
  that step's argmax canvas, so a committed token is the most probable one there and its
  logprob equals the first of its ``top_logprobs``); ``top_logprobs`` are the k most probable
  tokens of that distribution at its position. In the fast sampler probabilities below e^-87
  of the top token's are clamped there (never the top ones of any sensible k);
- structured outputs (``diffusion_plugin.api.structured``, ``diffusion_plugin.step.grammar``):
  ``response_format`` (``json_schema``, ``json_object``, ``text``) and vLLM's
  ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``structural_tag``);
  chat's ``tools`` with ``tool_choice`` ``"required"`` or a named function (the output is the
  tool calls, constrained to vLLM's tool-call schema), ``"none"`` (tools given to the chat
  template), and ``parallel_tool_calls``; ``tool_choice: "auto"`` (tools rendered by the chat
  template, the output parsed into ``tool_calls`` by vLLM's parser) with the model's tool parser
  (``engine_args.tool_call_parser``), else a 400 as on ``vllm serve``; the reasoning parser's
  ``reasoning`` (``engine_args.reasoning_parser``; ``diffusion_plugin.api.parsing``), vLLM's
  ``include_reasoning`` and ``chat_template_kwargs`` (e.g. ``enable_thinking``), and
  ``reasoning_effort`` as vLLM 0.32 means it on chat: given to the chat template, and it switches
  thinking on (``enable_thinking``: any effort but ``"none"``) unless ``chat_template_kwargs`` sets
  ``enable_thinking`` (``ChatBody.template_kwargs``);
- vLLM's sampling fields ``top_k``, ``top_p``, ``min_p``, ``allowed_token_ids``, ``logit_bias`` and ``min_tokens``
  (``diffusion_plugin.step.filters`` says what each does to a denoise step), with vLLM's checks and
  words (``_Base.check``);
- prompt scoring: completions' ``echo`` (with ``logprobs``: the prompt's tokens scored; with
  ``max_tokens`` 0 the prompt alone) and vLLM's ``prompt_logprobs`` (not with ``stream``); a
  prompt token's score is defined in ``request.BlockPlan`` / the README (score blocks);
- ``diffusion``'s canvas controls (``DiffusionKnobs``): ``seed_canvas``, ``pinned``, ``read_only``,
  ``canvas_length`` (the model's own only);
- accepted and recorded nowhere (they change no output): ``user``, ``metadata``,
  ``store: false``, ``service_tier: "auto"``.

Refused (400, ``param`` = the field) unless given its neutral value (or null):
``frequency_penalty`` / ``presence_penalty`` (0), ``repetition_penalty`` (1) (vLLM's native
DiffusionGemma ignores penalties with a warning: refused here, never silently ignored),
``best_of`` (1), ``suffix`` (""), ``functions`` ([]), ``function_call`` ("none"), ``store`` (false),
``prediction``, ``audio``, ``modalities`` (["text"]), ``reasoning_effort`` (completions),
``web_search_options``;
and any other field (``stream_options`` keys other than vLLM's two included).

Determinism: ``temperature: 0`` without a ``seed`` uses seed ``GREEDY_SEED`` (0), so the same
request gives the same answer, streamed or not; ``n`` > 1 uses seed + i for choice i.

vLLM's rules, in its words (``_Base.check``): ``stream_options`` only with ``stream``, and ``n``
must be 1 at ``temperature`` 0 (greedy sampling).
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from tandem_core.errors import invalid

GREEDY_T = 1e-4  # temperature 0 means near-greedy: both ends of the schedule this low
GREEDY_SEED = 0  # temperature 0 without a seed: this seed (deterministic)
GREEDY_EPS = 1e-5  # vLLM's: a temperature below it is greedy sampling (n must be 1)
MAX_TOP_LOGPROBS = 20
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # vLLM's
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # completions: prompts in one request (each has ``n`` choices)

# Fields accepted without effect on the output.
HARMLESS = frozenset({"user", "metadata"})
# field -> the values that mean "off" (accepted; anything else is refused). None is always off.
NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
    "best_of": (1,), "suffix": ("",), "functions": ([],), "function_call": ("none",), "store": (False,),
    "service_tier": ("auto",), "modalities": (["text"],), "prediction": (), "audio": (),
    "reasoning_effort": (), "web_search_options": (),
}


def template_kwargs(reasoning_effort: str | None, chat_template_kwargs: dict | None) -> dict[str, Any] | None:
    """A chat request's template kwargs, as vLLM's ``ChatCompletionRequest.build_chat_params`` makes
    them (the chat template and the parsers both read them): ``reasoning_effort`` goes to the
    template and switches thinking (``enable_thinking``: any effort but ``"none"``) unless the
    request's own ``chat_template_kwargs`` set it; theirs win."""
    effort = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort,
                                                  "enable_thinking": reasoning_effort != "none"}
    return {**effort, **(chat_template_kwargs or {})} or None


def refuse_unsupported(extra: dict[str, Any] | None, neutral: dict[str, tuple] | None = None) -> None:
    """400 naming the first field of ``extra`` (fields the model class does not declare) that is
    neither harmless nor given its neutral value (``neutral``: a route's own table)."""
    neutral = NEUTRAL if neutral is None else neutral
    for name, value in (extra or {}).items():
        if value is None or name in HARMLESS:
            continue
        if name in neutral:
            if any(_same(value, v) for v in neutral[name]):
                continue
            allowed = " or ".join(repr(v) for v in neutral[name]) or "null"
            raise invalid(f"{name}: not supported by the diffusion engine (only {allowed} is accepted)",
                          param=name)
        raise invalid(f"{name}: not supported by the diffusion engine", param=name)


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


class DiffusionKnobs(BaseModel):
    """Diffusion models only: denoising knobs (defaults: the model's generation config)."""

    model_config = ConfigDict(extra="forbid")

    # The canvas controls of vllm#57250 (the first generated block).
    seed_canvas: str | list[StrictInt] | None = Field(None, description="The first generated block's starting "
                                                      "canvas: token ids, or text (tokenized without special "
                                                      "tokens), at most the canvas length; the positions after it "
                                                      "start as noise.")
    pinned: list[StrictInt] | None = Field(None, description="Canvas positions (0-based, each within seed_canvas) "
                                           "held to their seed tokens at every step: they are committed as given.")
    canvas_length: int | None = Field(None, ge=1, description="The canvas width; only the model's own is served "
                                      "(the batched decoder forward runs one width).")
    read_only: bool = Field(False, description="One decoder pass over the first block (the seed canvas and "
                            "noise), nothing committed: the answer is that pass's argmax canvas (canvas length "
                            "tokens, finish 'length', EOS kept) with each position's logprob.")

    previews: bool = Field(False, description="Stream preview chunks (the current block's argmax canvas, "
                           "replacing the previous preview of that block) between committed blocks.")
    max_denoising_steps: int | None = Field(None, ge=1, le=1024, description="Denoising steps per block at most; "
                                            "the last one commits the block.")
    entropy_bound: float | None = Field(None, ge=0, description="Entropy-bound acceptance: each step keeps the "
                                        "lowest-entropy positions while their summed entropy stays within this "
                                        "bound, and renoises the others.")
    stability_threshold: int | None = Field(None, ge=0, le=64, description="Steps the argmax canvas must stay "
                                            "unchanged (with confidence_threshold met) to commit a block early.")
    confidence_threshold: float | None = Field(None, ge=0, description="A block commits early only while its "
                                               "mean entropy is below this.")
    # Below GREEDY_T, logits / t overflow float32 (the sampler would return garbage): such a
    # request is refused; ``temperature`` itself is floored there (near-greedy), as vLLM floors it.
    t_min: float | None = Field(None, ge=GREEDY_T, le=100, description="Sampling temperature at the block's last step "
                                "(the schedule runs from t_max down to t_min); at most t_max.")
    t_max: float | None = Field(None, ge=GREEDY_T, le=100,
                                description="Sampling temperature at the block's first step.")


CANVAS_CONTROLS = frozenset({"seed_canvas", "pinned", "canvas_length", "read_only"})  # the intake's


def knobs_schema() -> dict[str, Any]:
    """The JSON Schema of the ``diffusion`` request object: the diffusion engine's request schema,
    which the gateway's OpenAPI document embeds as is (one source: the two cannot drift). A null
    default ("the model's own") is left out, as OpenAPI documents leave out nulls."""
    schema = DiffusionKnobs.model_json_schema()
    for prop in schema["properties"].values():
        if "default" in prop and prop["default"] is None:
            del prop["default"]
    return schema


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)  # vLLM's range (int64)
    # vLLM's sampling fields (``diffusion_plugin.step.filters``)
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    allowed_token_ids: list[StrictInt] | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prompts under different salts share nothing
    priority: StrictInt = 0  # vLLM's: lower is more urgent; the scheduler admits waiting rows by it
    stop: str | list[str] | None = None
    n: StrictInt = 1  # 1..MAX_N (``check``: vLLM's words)
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: these ids end a choice too (even with ignore_eos)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended a choice stays in its text
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens in the text
    # Structured outputs (``diffusion_plugin.api.structured`` reads them with vLLM's request models).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    diffusion: DiffusionKnobs = Field(default_factory=DiffusionKnobs)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def check(self) -> None:
        """vLLM's request rules, in vLLM's words (a 400 naming the field)."""
        if self.stream_options and not self.stream:
            raise invalid("Stream options can only be defined when `stream=True`.", param="stream_options")
        unknown = next((k for k in self.stream_options or {} if k not in STREAM_OPTIONS), None)
        if unknown is not None:
            raise invalid(f"stream_options.{unknown}: not supported by the diffusion engine",
                          param=f"stream_options.{unknown}")
        if self.n < 1:
            raise invalid(f"n must be at least 1, got {self.n}.", param="n")
        if self.n > MAX_N:  # (vLLM's limit is VLLM_MAX_N_SEQUENCES; here each choice is a batch row)
            raise invalid(f"n must be at most {MAX_N}, got {self.n}. A diffusion request's choices are rows of "
                          "the denoising batch.", param="n")
        if self.n > 1 and self.temperature is not None and self.temperature < GREEDY_EPS:
            raise invalid(f"n must be 1 when using greedy sampling, got {self.n}.", param="n")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise invalid(f"top_p must be in (0, 1], got {self.top_p}.", param="top_p")
        if self.top_k is not None and self.top_k < -1:
            raise invalid(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.", param="top_k")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise invalid(f"min_p must be in [0, 1], got {self.min_p}.", param="min_p")
        if self.min_tokens < 0:
            raise invalid(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
                          param="min_tokens")
        limit = self.output_limit()
        if limit is not None and self.min_tokens > limit:
            raise invalid(f"min_tokens must be less than or equal to max_tokens={limit}, got {self.min_tokens}.",
                          param="min_tokens")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise invalid("allowed_token_ids is not None and empty!", param="allowed_token_ids")
        if self.prompt_logprobs is not None:
            if self.stream:  # (vLLM takes 0 with stream; a diffusion model then refuses it too)
                raise invalid("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
            if self.prompt_logprobs < 0 and self.prompt_logprobs != -1:
                raise invalid("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
            if self.prompt_logprobs > MAX_TOP_LOGPROBS or self.prompt_logprobs == -1:
                raise invalid(f"prompt_logprobs: at most {MAX_TOP_LOGPROBS} on diffusion models",
                              param="prompt_logprobs")
        d = self.diffusion
        if d.pinned and d.seed_canvas is None:
            raise invalid("diffusion.pinned: needs diffusion.seed_canvas", param="diffusion.pinned")

    def sampling_fields(self) -> dict[str, Any]:
        """The ``request.SamplingParams`` fields of vLLM's sampling knobs (off when not given)."""
        return {"top_k": max(0, self.top_k or 0), "top_p": 1.0 if self.top_p is None else self.top_p,
                "min_p": self.min_p or 0.0, "min_tokens": self.min_tokens,
                "allowed_token_ids": None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
                "logit_bias": self.logit_bias_pairs()}

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """vLLM's: keys are token ids (as strings), biases clamped to [-100, 100]."""
        bad = [k for k in self.logit_bias or {} if not k.strip().lstrip("-").isdigit()]
        if bad:
            raise invalid(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                          param="logit_bias")
        return tuple((int(k), min(100.0, max(-100.0, v))) for k, v in (self.logit_bias or {}).items())

    def scoring_k(self) -> int | None:
        """Prompt scoring wanted (``prompt_logprobs``; completions' ``echo`` with ``logprobs``): its
        top k, else None."""
        return self.prompt_logprobs

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats``: usage in every chunk (with include_usage)."""
        return self.include_usage() and bool((self.stream_options or {}).get("continuous_usage_stats"))

    def output_limit(self) -> int | None:
        return self.max_tokens

    def top_logprobs_k(self) -> int | None:
        """None: no logprobs; k: the committed tokens' logprobs and their top k."""
        return None


class ChatBody(_Base):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: false drops the parsed reasoning
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: to the chat template (enable_thinking...)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None  # vLLM's
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_kwargs(self) -> dict[str, Any] | None:
        return template_kwargs(self.reasoning_effort, self.chat_template_kwargs)

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Base):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt alone (its scores)
    echo: bool | None = False

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens must be at least 1, got 0.", param="max_tokens")

    def scoring_k(self) -> int | None:
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs  # vLLM's: echo scores the prompt with logprobs' k
        return self.prompt_logprobs

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list | str) and not p for p in v)):
            raise ValueError("a prompt cannot be empty")
        return v
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_k(self) -> int | None:
        return self.logprobs


def parse(cls: type[BaseModel], body: dict, neutral: dict[str, tuple] | None = None) -> BaseModel:
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first["loc"] if not str(p).startswith("function-")]
        field = ".".join(p for p in loc if not p.isdigit()) or None
        if first["type"] == "value_error" and not loc and "top_logprobs" in first["msg"]:
            field = "top_logprobs"
        kind = f" [type={first['type']}]" if first["type"] in _BOUNDS else ""  # as vLLM's, naming the bound
        raise invalid(f"{'.'.join(loc) or field or 'body'}: {first['msg']}{kind}", param=field) from None
    if not getattr(cls, "IGNORES_EXTRA", False):  # vLLM's tokenize routes ignore extra fields
        refuse_unsupported(req.model_extra, neutral)
    if isinstance(req, _Base):
        req.check()
    return req


_BOUNDS = frozenset({"less_than_equal", "less_than", "greater_than_equal", "greater_than"})


def resolve(req: BaseModel, defaults: dict[str, Any]) -> dict[str, Any]:
    """The effective per-sequence knobs: the request's, else the model's generation config."""
    knobs = {k: v for k, v in req.diffusion.model_dump(exclude=CANVAS_CONTROLS | {"previews"}).items() if v is not None}
    merged = {**defaults, **knobs}
    if req.temperature is not None and "t_min" not in knobs and "t_max" not in knobs:
        if req.temperature == 0:
            merged["t_min"] = merged["t_max"] = GREEDY_T
        else:  # scale the model's schedule so that it ends at `temperature`
            ratio = defaults["t_min"] / defaults["t_max"]
            merged["t_max"] = max(GREEDY_T, req.temperature)
            merged["t_min"] = max(GREEDY_T, req.temperature * ratio)
    if merged["t_min"] > merged["t_max"]:
        raise invalid("diffusion.t_min must not exceed diffusion.t_max", param="diffusion.t_min")
    if req.seed is not None:
        merged["seed"] = req.seed % 2**62  # a generator's and the hash's seed (choice i: seed + i)
    elif req.temperature == 0:
        merged["seed"] = GREEDY_SEED
    else:
        merged["seed"] = random.randrange(2**31)
    return merged
