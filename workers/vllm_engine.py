"""The autoregressive engine: vLLM's AsyncLLM behind vLLM's own OpenAI serving layer.

tandem does not re-implement chat templates, tools, structured outputs, logprobs, ``n``,
stop or seed: it builds vLLM's ``OpenAIServingChat``/``OpenAIServingCompletion`` exactly
as ``vllm serve`` does (``init_app_state`` with vLLM's own argument defaults) and hands them
the request body. Only the error shape is translated into tandem's taxonomy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ValidationError

from tandem_core.errors import EngineConfigError, ErrorKind, TandemError, config_error_line, invalid
from tandem_core.protocol import EngineInfo, EngineStats, Item
from workers import vllm_decisions
from workers.vllm_support import (
    SERVING,
    Totals,
    body_parser,
    build_vllm_args,
    dump_by_alias,
    dump_without_none,
    from_vllm_error,
    once,
    passthrough,
    response_events,
    validation_error,
    with_id,
)

logger = logging.getLogger(__name__)

class VllmEngine:
    """Implements ``tandem_core.protocol.Engine`` with vLLM."""

    def __init__(self, model: str, source: str, engine_args: dict[str, Any], avoid_worker_cores: bool = True,
                 lora_modules: dict[str, str] | None = None, aliases: list[str] | None = None):
        self.model = model
        self.aliases = list(aliases or [])  # more served names (vLLM's --served-model-name NAME ALIAS...)
        self.lora_modules = dict(lora_modules or {})  # name -> a local path (built-in ones resolved)
        self.avoid_worker_cores = avoid_worker_cores
        self.source = source
        self.engine_args = dict(engine_args)
        self._llm = None
        self._state = None
        self._totals = Totals()
        self._active: set[str] = set()  # requests being served (for abort's answer and count)
        self._aborted = 0  # requests aborted before their end (client gone, timeout)
        self._kv_cache_tokens: int | None = None  # the KV cache's capacity, known once started
        self.routes_served: frozenset[str] | None = None  # what vLLM built serving objects for, once started

    async def start(self) -> EngineInfo:
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = build_vllm_args(self.model, self.source, _traced(self.engine_args), self.lora_modules, self.aliases)
        try:
            eargs = AsyncEngineArgs.from_cli_args(args)
            vllm_config = eargs.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        except Exception as e:  # vLLM's reason, in one line that pickles (its ValidationError does not)
            raise EngineConfigError(config_error_line(self.model, self.engine_args, e)) from None
        self._llm = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=eargs.enable_log_requests,
            disable_log_stats=eargs.disable_log_stats,
            stat_loggers=[self._totals.factory()],
        )
        if self._llm.observability_config.otlp_traces_endpoint:
            _continue_traces(self._llm)
        # Set by the engine core at start-up (its KV blocks); the gateway sizes its prefix index on it.
        cache, par = vllm_config.cache_config, vllm_config.parallel_config
        self._kv_cache_tokens = (cache.num_gpu_blocks or 0) * (cache.block_size or 0) or None
        logger.info("%s: vLLM engine on %s, dtype %s, max_model_len %d, tensor_parallel_size %d x "
                    "pipeline_parallel_size %d (%s executor), KV cache %s tokens, enforce_eager %s",
                    self.model, vllm_config.device_config.device_type, str(vllm_config.model_config.dtype).removeprefix(
                        "torch."), vllm_config.model_config.max_model_len, par.tensor_parallel_size,
                    par.pipeline_parallel_size, par.distributed_executor_backend or "uniproc", self._kv_cache_tokens,
                    vllm_config.model_config.enforce_eager)
        supported = await self._llm.get_supported_tasks()
        self._state = State()
        await init_app_state(self._llm, self._state, args, supported)
        self.routes_served = frozenset(r for r, attr in SERVING.items()
                                       if getattr(self._state, attr, None) is not None)
        if self.avoid_worker_cores:
            from workers.cpu_affinity import keep_off_vllm_workers

            keep_off_vllm_workers()  # CPU backend only: its worker is pinned; stay off its cores
        return EngineInfo(
            model=self.model,
            kind="autoregressive",
            max_model_len=self._llm.model_config.max_model_len,
            extra={"source": self.source, "kv_cache_tokens": self._kv_cache_tokens},
        )

    # One method per route (``tandem_core.protocol.ROUTES``), each calling the serving object vLLM's
    # own route handler calls, as it calls it (vllm/entrypoints/**/api_router.py).

    def chat(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        if body.get("messages") == []:
            # vLLM says so too, but without naming the field.
            return once(invalid("messages: must contain at least one message", param="messages"))
        return self._serve(body, request_id, with_id(ChatCompletionRequest), "messages",
                           lambda r: self._state.openai_serving_chat.create_chat_completion(r, None))

    def completions(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return self._serve(body, request_id, with_id(CompletionRequest), "prompt",
                           lambda r: self._state.openai_serving_completion.create_completion(r, None))

    def responses(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """OpenAI's Responses API. ``request_id`` becomes the response's id (vLLM uses the
        request's): the gateway encodes this replica in it, so retrieval finds its store."""
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        return self._serve(body, request_id, with_id(ResponsesRequest), "input",
                           lambda r: self._responses().create_responses(r, None),
                           dump=dump_by_alias, events=response_events)

    def responses_retrieve(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return self._serve(body, request_id, passthrough, None,
                           lambda b: self._responses().retrieve_responses(
                               b["response_id"], starting_after=b.get("starting_after"), stream=b.get("stream")),
                           dump=dump_by_alias, events=response_events)

    def responses_cancel(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return self._serve(body, request_id, passthrough, None,
                           lambda b: self._responses().cancel_responses(b["response_id"]), dump=dump_by_alias)

    def messages(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """Anthropic's Messages API (the gateway gives its errors Anthropic's shape)."""
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        return self._serve(body, request_id, body_parser(AnthropicMessagesRequest.model_validate), "messages",
                           lambda r: self._state.anthropic_serving_messages.create_messages(r, None),
                           dump=dump_without_none)

    def messages_count_tokens(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

        return self._serve(body, request_id, body_parser(AnthropicCountTokensRequest.model_validate), "messages",
                           lambda r: self._state.anthropic_serving_messages.count_tokens(r, None),
                           dump=dump_without_none)

    def tokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

        return self._serve(body, request_id, body_parser(TypeAdapter(TokenizeRequest).validate_python), "prompt",
                           lambda r: self._state.serving_tokenization.create_tokenize(r, None))

    def detokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        return self._serve(body, request_id, body_parser(DetokenizeRequest.model_validate), "tokens",
                           lambda r: self._state.serving_tokenization.create_detokenize(r, None))

    def systemone(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """vLLM's /v1/systemone, through its own serving object (``workers.vllm_decisions``)."""
        from vllm.entrypoints.generate.structured_decisions.protocol import StructuredDecisionRequest

        return self._serve(body, request_id, with_id(StructuredDecisionRequest), None,
                           lambda r: vllm_decisions.systemone(self._state, r))

    def decisions(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """OpenAI's /v1/decisions: label reads through vLLM (``workers.vllm_decisions``)."""
        return self._serve(body, request_id, passthrough, None, lambda b: vllm_decisions.decisions(
            self._llm, self._state, self.model, b, request_id))

    # vLLM's pooling routes (a pooling model: an embedding, classification or scoring one). Their
    # handlers answer a starlette response; its JSON body is the answer.

    def embeddings(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from pydantic import TypeAdapter
        from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

        if body.get("encoding_format") in ("bytes", "bytes_only"):  # a binary body: not an OpenAI answer
            return once(invalid("encoding_format: tandem serves embeddings as float or base64 (vLLM's bytes "
                                 "formats are not served)", param="encoding_format"))
        return self._serve(body, request_id, body_parser(TypeAdapter(EmbeddingRequest).validate_python), "input",
                           lambda r: self._pool("serving_embedding", r))

    def pooling(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from pydantic import TypeAdapter
        from vllm.entrypoints.pooling.pooling.protocol import PoolingRequest

        return self._serve(body, request_id, body_parser(TypeAdapter(PoolingRequest).validate_python), "input",
                           lambda r: self._pool("serving_pooling", r))

    def classify(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from pydantic import TypeAdapter
        from vllm.entrypoints.pooling.classify.protocol import ClassificationRequest

        return self._serve(body, request_id, body_parser(TypeAdapter(ClassificationRequest).validate_python), "input",
                           lambda r: self._pool("serving_classification", r))

    def score(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from pydantic import TypeAdapter
        from vllm.entrypoints.pooling.scoring.protocol import ScoreRequest

        return self._serve(body, request_id, body_parser(TypeAdapter(ScoreRequest).validate_python), None,
                           lambda r: self._pool("serving_scores", r))

    score_v1 = score

    def rerank(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from vllm.entrypoints.pooling.scoring.protocol import RerankRequest

        return self._serve(body, request_id, body_parser(RerankRequest.model_validate), None,
                           lambda r: self._pool("serving_scores", r))

    rerank_v1 = rerank

    async def _pool(self, attr: str, request):
        import json

        handler = getattr(self._state, attr, None)
        if handler is None:
            raise NotImplementedError(f"The model does not support this API ({attr})")
        response = await handler(request, None)
        if isinstance(response, BaseModel):
            return response
        return json.loads(response.body)

    def _responses(self):
        handler = self._state.openai_serving_responses
        if handler is None:  # as vLLM's route handler says
            raise NotImplementedError("The model does not support Responses API")
        return handler

    async def _serve(self, body: dict, request_id: str, parse, prompt_field: str | None, handle,
                     dump=None, events=None) -> AsyncIterator[Item]:
        """``parse(body, request_id)`` builds vLLM's request; ``handle`` serves it; ``dump`` turns
        a whole answer into JSON, ``events`` a stream of event objects into SSE text (streams of
        text pass as they are)."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.exceptions import VLLMClientError

        self._active.add(request_id)
        try:
            try:
                # vLLM's request models raise its own VLLMValidationError from validators (not a
                # ValueError, so pydantic does not wrap it): a 400 like the rest, as vLLM's server says.
                request = parse(body, request_id)
                result = await handle(request)
            except ValidationError as e:
                yield validation_error(e)
                return
            except TandemError as e:  # tandem's own refusal (``decisions``), already framed
                yield e
                return
            except Exception as e:  # noqa: BLE001 - vLLM raises some request errors; map them as its server does
                result = create_error_response(e)
            if isinstance(result, dict):  # a pooling route's JSON answer
                yield result
            elif isinstance(result, ErrorResponse):
                err = from_vllm_error(result)
                if err.kind is ErrorKind.CONTEXT_TOO_LONG and prompt_field:
                    err = TandemError(err.kind, err.message, prompt_field)
                yield err
            elif isinstance(result, BaseModel):
                yield dump(result) if dump is not None else result.model_dump(mode="json")
            else:
                if events is not None:
                    result = events(result)
                try:
                    async for chunk in result:
                        yield chunk
                except VLLMClientError as e:  # a request error found while streaming: its own answer, not a 500
                    yield from_vllm_error(create_error_response(e))  # framed by the gateway for its route
        finally:
            self._active.discard(request_id)

    async def abort(self, request_id: str) -> bool:
        # Requests are aborted by cancelling their iterator (vLLM aborts on CancelledError; its
        # non-streaming path turns that into an error response): the actor shell cancels it right
        # after this call. Here it is only answered and counted.
        if request_id not in self._active:
            return False
        self._aborted += 1
        return True

    async def check_health(self) -> None:
        """vLLM's own check (its engine core died), and, while no request runs, a round trip to the
        engine core (a utility call): a core that hangs while idle never answers, and the gateway's
        health timeout takes the replica out of rotation before a request lands on it. With
        requests running, their progress is the check (the gateway's ``stall_timeout_s``)."""
        if self._llm is None:
            raise RuntimeError("engine not started")
        await self._llm.check_health()
        if self._llm.output_processor.get_num_unfinished_requests() == 0:
            await self._llm.is_sleeping()

    async def reset_prefix_cache(self) -> bool:
        if self._llm is None:
            return True
        return bool(await self._llm.reset_prefix_cache())

    async def lora(self, op: str, body: dict) -> str:
        """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, through its serving object."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

        if self._state is None:
            raise TandemError(ErrorKind.ENGINE_ERROR, "the engine is not started")
        if self._llm.vllm_config.lora_config is None:  # as vLLM's engine would refuse it, in one line
            raise invalid(f"model {self.model!r} was not started with LoRA support: set lora_modules, or "
                          "engine_args enable_lora: true", param="model")
        models = self._state.openai_serving_models
        try:
            if op == "load":
                result = await models.load_lora_adapter(LoadLoRAAdapterRequest.model_validate(body))
            else:
                result = await models.unload_lora_adapter(UnloadLoRAAdapterRequest.model_validate(body))
        except ValidationError as e:
            raise validation_error(e) from None
        if isinstance(result, ErrorResponse):
            raise from_vllm_error(result)
        return result

    async def stats(self) -> EngineStats:
        if self._llm is None:
            return EngineStats(running=0)
        running = self._llm.output_processor.get_num_unfinished_requests()
        extra = {**self._totals.values, "aborted": self._aborted, "kv_cache_tokens": self._kv_cache_tokens,
                 "exposition": vllm_exposition()}
        return EngineStats(running=running, waiting=extra.pop("waiting"), extra=extra,
                           progress=extra["prompt_tokens"] + extra["generation_tokens"])

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


def _traced(engine_args: dict) -> dict:
    """With the replica's tracing on, vLLM exports its own ``llm_request`` spans to the same
    collector (``--otlp-traces-endpoint``; an endpoint set in engine_args wins)."""
    from tandem_core import tracing

    settings = tracing.settings()
    if settings is None or engine_args.get("otlp_traces_endpoint"):
        return engine_args
    endpoint, protocol = tracing.vllm_exporter(settings["endpoint"])
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)  # vLLM's exporter reads it
    return {**engine_args, "otlp_traces_endpoint": endpoint}


def _continue_traces(llm) -> None:
    """vLLM's serving objects take a request's trace context from its HTTP headers, which a
    replica has none of (``raw_request`` is None): its requests are given the replica's span of
    the request (``tracing.TRACE``, set in the request's task) instead, so vLLM's ``llm_request``
    span is that span's child."""
    from tandem_core import tracing

    add_request = llm.add_request

    async def add_request_in_trace(*args, trace_headers=None, **kwargs):
        return await add_request(*args, trace_headers=trace_headers or tracing.TRACE.get(), **kwargs)

    llm.add_request = add_request_in_trace


def vllm_exposition() -> str:
    """vLLM's own metrics (its ``vllm:*`` families, as `vllm serve`'s /metrics has them), in the
    Prometheus text format: its stat logger registers them in this process's default registry.
    The gateway re-exports them with a ``replica`` label (``gateway.observability.metrics``)."""
    from prometheus_client import REGISTRY, generate_latest

    keep, out = False, []
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith("# HELP "):
            keep = line[7:].startswith("vllm:")
        if keep:
            out.append(line)
    return "\n".join(out) + "\n" if out else ""


def create_engine(cfg, source_path: str) -> VllmEngine:
    """The ``autoregressive`` entry in ``workers.registry``."""
    return VllmEngine(cfg.name, source_path, cfg.engine_args, lora_modules=cfg.lora_modules, aliases=cfg.aliases)
