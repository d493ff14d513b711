"""Request adaptation: an OpenAI body (already validated by ``diffusion_plugin.api.params``) -> a
``SeqRequest``, what the batcher's sequences are built from.

The prompt through the model's chat template (image parts decoded and encoded off the event
loop), the effective knobs, and the two refusals that need the model: the context length and the
memory budget (a 400 naming the field, before anything is queued). Also ``/tokenize`` and
``/detokenize``, which only need the tokenizer. Raises ``TandemError``; imports no torch.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace

from diffusion_plugin.api import params as P
from diffusion_plugin.api.images import ImageLimits, extract_images, load_images
from diffusion_plugin.api.token_params import DetokenizeBody, TokenizeBody
from diffusion_plugin.batcher.memory import GIB, MemoryBudget
from diffusion_plugin.batcher.request import SamplingParams, Sequence
from tandem_core.errors import ErrorKind, TandemError, invalid

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class PromptSpec:
    """What a request's sequences read before they generate."""

    ids: list[int]  # the prompt (completions: the first of ``prompts``)
    more: tuple[list[int], ...] = ()  # completions: the prompts after the first
    images: object | None = None  # the family's encoded images, or None
    cache_salt: str | None = None  # vLLM's: the prefix cache shares pages only under one salt
    score_k: int | None = None  # prompt scoring (echo with logprobs, prompt_logprobs): the top k, else None

    @property
    def prompts(self) -> list[list[int]]:
        return [self.ids, *self.more]


@dataclass(frozen=True)
class OutputSpec:
    """What a request's answer shows of its sequences' tokens."""

    n: int = 1  # choices per prompt
    stops: tuple[str, ...] = ()
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    keep_special: bool = False  # vLLM's skip_special_tokens: false
    raw_text: bool = False  # a parser reads the text: special tokens kept, whole tokens (``chunks.ChoiceText``)
    echo: bool = False  # completions: the prompt's text (and with scoring its entries) first
    prompt_logprobs: bool = False  # vLLM's ``prompt_logprobs`` in the answer


@dataclass(frozen=True)
class SeqRequest:
    """One request as the batcher sees it, typed: its prompt, every choice's sampling (choice i
    of a prompt draws from ``params.seed + i``; EOS and stop token ids already merged) and its
    output. Built once (``Intake``, then ``prepare``) and not changed."""

    prompt: PromptSpec
    params: SamplingParams
    output: OutputSpec
    priority: int = 0  # vLLM's: waiting rows are admitted most urgent first
    grammar: object | None = None  # a structured output's compiled grammar (``diffusion_plugin.step.grammar``)

    @property
    def choices(self) -> int:
        return self.output.n * len(self.prompt.prompts)

    def sequences(self, request_id: str) -> list[Sequence]:
        """Choice ``p * n + i`` (prompt p's choice i, indexed as vLLM indexes a list of prompts) is
        ``<request_id>-<p * n + i>`` with seed + i."""
        n = self.output.n
        scoring = self.prompt.score_k is not None  # the first token encoded, the rest read in score blocks
        return [Sequence(seq_id=f"{request_id}-{p * n + i}", prompt_ids=list(prompt[:1] if scoring else prompt),
                         params=replace(self.params, seed=self.params.seed + i), images=self.prompt.images,
                         grammar=self.grammar, score_ids=list(prompt[1:]) if scoring else [],
                         score_k=self.prompt.score_k or 0, cache_salt=self.prompt.cache_salt, priority=self.priority)
                for p, prompt in enumerate(self.prompt.prompts) for i in range(n)]


class Intake:
    def __init__(self, model: str, adapter, image_limits: ImageLimits, scheduler, memory: MemoryBudget | None):
        self.model = model
        self.adapter = adapter
        self.image_limits = image_limits
        self.scheduler = scheduler  # for ``fits_alone``
        self.memory = memory
        self.image_stats = {"images": 0, "image_requests": 0, "image_encode_s": 0.0}

    # -- the generation routes --------------------------------------------------------------
    async def chat(self, req: P.ChatBody) -> SeqRequest:
        return await self._prepare(req, req.messages, "messages", "max_tokens", req.output_limit(), req.n,
                                   req.stops(), req.top_logprobs_k(), req.tools, req.template_kwargs())

    async def completion(self, req: P.CompletionBody) -> SeqRequest:
        return await self._prepare(req, None, "prompt", "max_tokens", req.output_limit(), req.n, req.stops(),
                                   req.top_logprobs_k())

    async def responses(self, req, messages: list, tools: list | None = None) -> SeqRequest:
        return await self._prepare(req, messages, "input", "max_output_tokens", req.max_output_tokens, 1, [], None,
                                   tools)

    async def _prepare(self, req, messages: list | None, field: str, limit_field: str, max_tokens: int | None,
                       n: int, stops: list[str], logprobs: int | None, tools: list | None = None,
                       template_kwargs: dict | None = None) -> SeqRequest:
        images, more = None, []
        if messages is not None:
            prompt_ids, images = await self.chat_prompt(messages, tools, template_kwargs)
        else:
            prompt_ids, *more = self._completion_prompts(req.prompt)
        knobs = P.resolve(req, self.adapter.defaults())
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        ignore_eos = getattr(req, "ignore_eos", False)
        sampling = req.sampling_fields() if hasattr(req, "sampling_fields") else {}
        stop_ids = tuple(self._token_prompt(getattr(req, "stop_token_ids", None) or [], "stop_token_ids",
                                            "stop_token_ids"))
        if hasattr(req, "sampling_fields"):
            sampling.update(self._canvas_controls(req.diffusion))
            self._check_sampling(sampling)
            if req.diffusion.read_only:  # one pass over the first block, its argmax returned as is
                knobs["max_denoising_steps"] = 1
                max_tokens, ignore_eos = self.adapter.canvas_length, True
                logprobs = 0 if logprobs is None else logprobs
        score_k = req.scoring_k() if hasattr(req, "scoring_k") else None
        if score_k is not None and images is not None:
            raise invalid("prompt_logprobs: not served with image input on diffusion models", param="prompt_logprobs")
        for prompt in (prompt_ids, *more):
            self._check_fits(prompt, max_tokens, knobs, field, limit_field)
        eos = (() if ignore_eos else tuple(self.adapter.eos_token_ids)) + stop_ids
        params = SamplingParams(max_tokens=max_tokens, eos_token_ids=eos, logprobs=logprobs,
                                previews=req.diffusion.previews and req.stream, **sampling, **knobs)
        prompt = PromptSpec(prompt_ids, tuple(more), images, getattr(req, "cache_salt", None), score_k)
        output = OutputSpec(n, tuple(stops), bool(getattr(req, "include_stop_str_in_output", False)),
                            not getattr(req, "skip_special_tokens", True), echo=bool(getattr(req, "echo", False)),
                            prompt_logprobs=getattr(req, "prompt_logprobs", None) is not None)
        return SeqRequest(prompt, params, output, priority=getattr(req, "priority", 0) or 0)

    def _canvas_controls(self, d: P.DiffusionKnobs) -> dict:
        """``diffusion``'s canvas controls -> ``SamplingParams``' ``seed_canvas`` and ``pinned``."""
        C = self.adapter.canvas_length
        if d.canvas_length is not None and d.canvas_length != C:
            raise invalid(f"diffusion.canvas_length: only this model's canvas ({C}) is served: one decoder "
                          f"forward runs one canvas width for its whole batch", param="diffusion.canvas_length")
        if d.seed_canvas is None:
            return {}
        if isinstance(d.seed_canvas, str):
            seed = self.adapter.tokenizer(d.seed_canvas, add_special_tokens=False).input_ids
        else:
            seed = self._token_prompt(d.seed_canvas, "diffusion.seed_canvas", "diffusion.seed_canvas")
        if not seed or len(seed) > C:
            raise invalid(f"diffusion.seed_canvas: 1 to {C} tokens (the canvas), got {len(seed)}",
                          param="diffusion.seed_canvas")
        pinned = sorted(set(d.pinned or []))
        bad = next((j for j in pinned if not 0 <= j < len(seed)), None)
        if bad is not None:
            raise invalid(f"diffusion.pinned: position {bad} is outside the seed canvas (0..{len(seed) - 1})",
                          param="diffusion.pinned")
        return {"seed_canvas": tuple(seed), "pinned": tuple(pinned)}

    def _check_sampling(self, sampling: dict) -> None:
        bad = [t for t, _ in sampling.get("logit_bias") or () if not 0 <= t < self.adapter.vocab_size]
        if bad:
            raise invalid(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                          f"{self.adapter.vocab_size}", param="logit_bias")
        allowed = sampling.get("allowed_token_ids")
        if allowed is None:
            return
        vocab = self.adapter.vocab_size
        if any(not 0 <= t < vocab for t in allowed):
            raise invalid("allowed_token_ids contains out-of-vocab token id!", param="allowed_token_ids")
        eos = set(self.adapter.eos_token_ids)
        if sampling.get("min_tokens") and set(allowed) <= eos:
            raise invalid("allowed_token_ids: only EOS ids, which min_tokens refuses", param="allowed_token_ids")

    def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        """Completions' ``prompt`` in every form vLLM takes: a string, a list of strings, token ids,
        or a list of token-id lists -> one token-id list per prompt."""
        if isinstance(prompt, str):
            return [self.prompt_ids(None, prompt)]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [self._token_prompt(prompt, "prompt")]
        if len(prompt) > P.MAX_PROMPTS:
            raise invalid(f"prompt: at most {P.MAX_PROMPTS} prompts in one request", param="prompt")
        return [self.prompt_ids(None, p) if isinstance(p, str) else self._token_prompt(p, f"prompt.{i}")
                for i, p in enumerate(prompt)]

    def _token_prompt(self, ids: list[int], where: str, param: str = "prompt") -> list[int]:
        vocab = len(self.adapter.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"{where}: token id {bad} is out of vocabulary (size {vocab})", param=param)
        return list(ids)

    async def chat_prompt(self, messages: list, tools: list | None = None,
                          template_kwargs: dict | None = None) -> tuple[list[int], object | None]:
        """A chat prompt's token ids, each image's placeholder expanded to its soft tokens, and the
        request's encoded images (None: none): what a chat request is billed for."""
        messages, images = await self.images(messages)
        prompt_ids = self.prompt_ids(messages, None, tools, template_kwargs)
        if images is not None:
            try:
                prompt_ids = self.adapter.expand_image_tokens(prompt_ids, images.num_soft_tokens)
            except ValueError as e:
                raise invalid(f"messages: {e}", "messages") from None
        return prompt_ids, images

    def prompt_ids(self, messages: list | None, prompt: str | None, tools: list | None = None,
                   template_kwargs: dict | None = None) -> list[int]:
        """The prompt's token ids: ``messages`` through the chat template, else ``prompt`` as text."""
        tok = self.adapter.tokenizer
        if messages is not None:
            messages = _with_argument_dicts(messages)
            kwargs = {k: v for k, v in (template_kwargs or {}).items()
                      if k not in ("messages", "tools", "add_generation_prompt", "tokenize", "return_dict")}
            try:  # tools go to the chat template, as vLLM gives them (whatever the tool_choice)
                return tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                               tokenize=True, return_dict=False, **kwargs)
            except Exception as e:  # noqa: BLE001 - a malformed message is the client's error
                raise invalid(f"messages: cannot apply the chat template: {e}", param="messages") from None
        return tok(prompt).input_ids

    async def images(self, messages: list) -> tuple[list, object | None]:
        """The messages with image parts as placeholders, and the request's encoded images (None
        without any). Decoding and the vision tower run in a worker thread, not in the denoise
        loop: a large image delays its own request, not the other sequences' steps."""
        messages, sources = extract_images(messages, self.image_limits)
        if not sources:
            return messages, None
        if not self.adapter.has_vision:
            raise invalid(f"messages: model {self.model!r} does not take image input", "messages")
        pictures = await load_images(sources, self.image_limits)
        t0 = time.perf_counter()
        embeds = await asyncio.to_thread(self.adapter.encode_images, pictures)
        self.image_stats["image_encode_s"] += time.perf_counter() - t0
        self.image_stats["images"] += len(pictures)
        self.image_stats["image_requests"] += 1
        return messages, embeds

    def _check_fits(self, prompt_ids: list[int], max_tokens: int, knobs: dict, field: str, limit_field: str) -> None:
        limit = self.adapter.max_position
        if limit and len(prompt_ids) + max_tokens + self.adapter.canvas_length > limit:
            raise TandemError(ErrorKind.CONTEXT_TOO_LONG,
                              f"This model's maximum context length is {limit} tokens; the prompt has "
                              f"{len(prompt_ids)} and {limit_field} is {max_tokens}.", field)
        if not self.scheduler.fits_alone(Sequence("probe", prompt_ids, SamplingParams(
                max_tokens=max_tokens, seed=0, **{k: v for k, v in knobs.items() if k != "seed"}))):
            longest = self.memory.max_prompt_tokens(max_tokens)
            budget = self.memory.budget_bytes / GIB
            if longest > 0:
                raise TandemError(ErrorKind.CONTEXT_TOO_LONG,
                                  f"{field}: the prompt ({len(prompt_ids)} tokens) with {limit_field} {max_tokens} "
                                  f"needs more than this replica's memory budget ({budget:.2f} GiB); with that "
                                  f"{limit_field} the prompt may have at most {longest} tokens", field)
            raise TandemError(ErrorKind.CONTEXT_TOO_LONG,
                              f"{limit_field}: {max_tokens} needs more than this replica's memory budget "
                              f"({budget:.2f} GiB) even with an empty prompt", limit_field)

    # -- tokenize, detokenize ---------------------------------------------------------------
    def tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize: ``prompt`` (add_special_tokens, default true) or ``messages`` through
        the model's chat template (add_generation_prompt, default true); return_token_strs."""
        req = P.parse(TokenizeBody, body)
        tok = self.adapter.tokenizer
        if req.messages is not None:
            if req.prompt is not None:
                raise invalid("give either prompt or messages, not both", param="prompt")
            messages, _ = extract_images(req.messages, self.image_limits)
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                               continue_final_message=req.continue_final_message, tokenize=False)
            except Exception as e:  # noqa: BLE001 - a malformed message is the client's error
                raise invalid(f"messages: cannot apply the chat template: {e}", param="messages") from None
            ids = tok(text, add_special_tokens=req.add_special_tokens).input_ids
        elif req.prompt is not None:
            ids = tok(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        else:
            raise invalid("prompt: field required (or messages)", param="prompt")
        return {"count": len(ids), "max_model_len": self.adapter.max_position, "tokens": list(ids),
                "token_strs": tok.convert_ids_to_tokens(list(ids)) if req.return_token_strs else None}

    def detokenize(self, body: dict) -> dict:
        """vLLM's /detokenize: ``tokens`` -> ``prompt`` (special tokens kept, so it round-trips)."""
        req = P.parse(DetokenizeBody, body)
        vocab_size = len(self.adapter.tokenizer)
        bad = next((t for t in req.tokens if t >= vocab_size), None)
        if bad is not None:
            raise invalid(f"tokens: token id {bad} is out of vocabulary (size {vocab_size})", param="tokens")
        return {"prompt": self.adapter.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _with_argument_dicts(messages: list) -> list:
    """Assistant tool calls' ``arguments`` as dicts, as vLLM gives them to chat templates (OpenAI
    sends JSON strings; templates such as Gemma 4's write a dict in the model's own syntax). An
    argument string that is not a JSON object stays a string."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if m.get("role") == "assistant" and isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_call_with_dict(c) for c in calls]}
        out.append(m)
    return out


def _call_with_dict(call):
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call
