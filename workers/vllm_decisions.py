"""Decisions on autoregressive models: OpenAI's ``/v1/decisions`` and vLLM's ``/v1/systemone``.

``/v1/systemone`` is vLLM's own serving object (``ServingStructuredDecisions``), called as its
route handler calls it: on an architecture its read strategies do not list, vLLM has none and
answers 501, and so does tandem.

``/v1/decisions`` reads labels through vLLM on any model it serves (``tandem_core.label_reads``):
each question's prompt is rendered by vLLM's own chat renderer (the chat route's template and
defaults, thinking off, images through its processor), and each probe is one vLLM request of one
token at temperature 0 whose ``logprob_token_ids`` are the candidates, run by vLLM's own
``next_token_label_reads``. Probes of one question share its prompt, so vLLM's prefix cache
prefills it once.
"""

from __future__ import annotations

from tandem_core import decisions as D
from tandem_core.errors import ErrorKind, TandemError, invalid
from tandem_core.label_reads import Probe, ProbeResult

PROBES_PER_CALL = 64  # probes in flight at once, at least (vLLM's /v1/systemone takes at most 64 questions)


class VllmReader:
    """``tandem_core.label_reads.Reader`` over a started ``VllmEngine``'s AsyncLLM and serving
    state (``init_app_state``'s)."""

    def __init__(self, llm, state, request_id: str, priority: int = 0):
        self.llm, self.state = llm, state
        # As many probes in flight as the engine batches in one step (the rest would only queue)
        self.chunk = max(PROBES_PER_CALL, self.llm.vllm_config.scheduler_config.max_num_seqs or 0)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_len = self.llm.model_config.max_model_len
        self.sees = self.llm.model_config.is_multimodal_model
        self.request_id = request_id
        self.priority = priority
        self._inputs: dict[tuple, dict] = {}  # prompt ids -> the renderer's engine input (images)
        self._calls = 0

    async def render(self, messages: list[dict], salt: str | None) -> list[int]:
        from vllm.entrypoints.generate.structured_decisions.protocol import ReadPromptRequest
        from vllm.renderers.inputs.preprocess import extract_prompt_components

        chat = self.state.openai_serving_chat
        try:
            _, (engine_input,) = await self.state.online_renderer.preprocess_chat(
                ReadPromptRequest(cache_salt=salt), messages, default_template=chat.chat_template,
                default_template_content_format=chat.chat_template_content_format,
                default_template_kwargs=chat.default_chat_template_kwargs, skip_mm_cache=True)
        except Exception as e:  # noqa: BLE001 - vLLM's renderer refuses the question (the question's refusal)
            raise invalid(f"the prompt cannot be rendered: {e}") from None
        ids = list(extract_prompt_components(self.llm.model_config, engine_input).token_ids or [])
        self._inputs[tuple(ids)] = engine_input
        return ids

    async def probe(self, probes: list[Probe], salt: str | None) -> list[ProbeResult]:
        from vllm.entrypoints.generate.label_reads import next_token_label_reads
        from vllm.inputs import tokens_input
        from vllm.sampling_params import SamplingParams

        inputs, params = [], []
        for p in probes:
            base = self._inputs.get(tuple(p.prompt_ids[:p.prompt_len]))
            if base is not None and base.get("type") != "token":  # images: the renderer's input, extended
                inputs.append({**base, "prompt_token_ids": list(p.prompt_ids)})
            else:
                inputs.append(tokens_input(list(p.prompt_ids), cache_salt=salt))
            params.append(SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(p.candidates)))
        self._calls += 1
        try:
            reads = await next_token_label_reads(self.llm, inputs, params, f"{self.request_id}-{self._calls}",
                                                 priority=self.priority)
        except ValueError as e:
            raise TandemError(ErrorKind.ENGINE_ERROR, f"a label read failed: {e}") from None
        out = []
        for r in reads:
            tokens = r.result.outputs[0].token_ids
            out.append(ProbeResult(r.logprobs, tokens[0] if tokens else None, r.result.num_cached_tokens or 0))
        return out


async def decisions(llm, state, model: str, body: dict, request_id: str) -> dict:
    """OpenAI's ``Decision`` for ``body``. Raises TandemError."""
    return await D.decide(body, model, lambda priority: VllmReader(llm, state, request_id, priority))


async def systemone(state, request):
    """vLLM's ``/v1/systemone`` handler's call, as its route makes it (501 without a strategy)."""
    handler = getattr(state, "serving_structured_decisions", None)
    if handler is None:  # as vLLM's route handler says
        raise NotImplementedError("The model does not support the structured decision API")
    return await handler.create_decision(request, None)
