"""The autoregressive engine: vLLM's AsyncLLM behind vLLM's own OpenAI serving layer.

tandem does not re-implement chat templates, tools, structured outputs, logprobs, ``n``,
stop or seed: it builds vLLM's ``OpenAIServingChat``/``OpenAIServingCompletion`` exactly
as ``vllm serve`` does (``init_app_state`` with vLLM's own argument defaults) and hands them
the request body. Only the error shape is translated into tandem's taxonomy.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ValidationError

from tandem_core.errors import EngineConfigError, ErrorKind, TandemError, config_error_line, invalid, kind_for_status
from tandem_core.protocol import EngineInfo, EngineStats, Item

logger = logging.getLogger(__name__)

MAX_LISTED_ERRORS = 8
_CONTEXT_MARKERS = ("maximum context length", "context length", "max_model_len", "too long")


def build_vllm_args(model: str, source: str, engine_args: dict[str, Any],
                    lora_modules: dict[str, str] | None = None) -> argparse.Namespace:
    """vLLM's own `serve` defaults, with ``engine_args`` applied on top unchanged;
    ``lora_modules`` (name -> path) as ``--enable-lora --lora-modules name=path ...``.

    Raises ValueError naming the first key vLLM does not know.
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="tandem-vllm"))
    argv = ["--model", source, "--served-model-name", model]
    if lora_modules:
        argv += ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    args = parser.parse_args(argv)
    for key, value in engine_args.items():
        if not hasattr(args, key):
            raise ValueError(f"engine_args.{key}: not a vLLM engine or serving argument")
        setattr(args, key, value)
    return args


def check_engine_args(model: str, source: str, engine_args: dict[str, Any], env: dict[str, str]) -> None:
    """vLLM's own checks of a model's configuration (the model config: lengths, dtype, tokenizer),
    as its engine will make them, with the model's ``env`` set meanwhile; cheap for a local model
    (its config.json). Raises EngineConfigError with vLLM's reason in one line."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        try:
            AsyncEngineArgs.from_cli_args(build_vllm_args(model, source, engine_args)).create_model_config()
        except Exception as e:  # noqa: BLE001 - any refusal is the configuration's
            raise EngineConfigError(config_error_line(model, engine_args, e)) from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _validation_error(err: ValidationError) -> TandemError:
    """The first error leads (and names the field); the others follow, as vLLM's server lists
    every one: for a field of several accepted shapes (``prompt``) the one that applies may not
    be first (nested token ids: "Input should be greater than or equal to 0")."""
    errors = err.errors()
    loc = [str(p) for p in errors[0]["loc"]]
    param = loc[0] if loc else None
    parts = []
    for e in errors[:MAX_LISTED_ERRORS]:
        part = f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
        if part not in parts:
            parts.append(part)
    more = len(errors) - MAX_LISTED_ERRORS
    return invalid("; ".join(parts) + (f"; and {more} more" if more > 0 else ""), param=param)


def _from_vllm_error(resp: Any) -> TandemError:
    """vLLM's ErrorResponse -> TandemError (one place; the gateway maps kinds to HTTP)."""
    info = resp.error
    message = info.message
    kind = kind_for_status(int(info.code))
    if kind is ErrorKind.MODEL_NOT_FOUND and info.param != "model":  # e.g. a response id
        kind = ErrorKind.NOT_FOUND
    if kind is ErrorKind.INVALID_REQUEST and any(m in message.lower() for m in _CONTEXT_MARKERS):
        kind = ErrorKind.CONTEXT_TOO_LONG
    return TandemError(kind, message, info.param)


async def _once(item: Item) -> AsyncIterator[Item]:
    yield item


def _with_id(request_cls):
    """Parse a body as ``request_cls`` with the gateway's request id (vLLM's ``request_id``)."""
    return lambda body, request_id: request_cls.model_validate({**body, "request_id": request_id})


def _body(validate):
    """Parse a body with ``validate`` (a request model without a ``request_id``)."""
    return lambda body, request_id: validate(body)


def _plain(body: dict, request_id: str) -> dict:
    return body


def _dump_by_alias(result: BaseModel) -> dict:
    return result.model_dump(mode="json", by_alias=True)


def _dump_without_none(result: BaseModel) -> dict:
    return result.model_dump(mode="json", exclude_none=True)


async def _response_events(events) -> AsyncIterator[str]:
    """Responses API events as SSE, exactly as vLLM's route handler frames them."""
    async for event in events:
        data = event.model_dump_json(indent=None, by_alias=True)
        yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {data}\n\n"


class _Totals:
    """vLLM's own per-step stats, accumulated (a StatLoggerBase fed by AsyncLLM): tandem does
    not count tokens itself, so nothing is counted twice."""

    def __init__(self) -> None:
        self.values = {"waiting": 0, "kv_cache_usage": 0.0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                       "prompt_tokens": 0, "generation_tokens": 0, "scheduler_running": 0}

    def factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        totals = self

        class TandemStatLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                v = totals.values
                if scheduler_stats is not None:
                    v["scheduler_running"] = scheduler_stats.num_running_reqs
                    v["waiting"] = scheduler_stats.num_waiting_reqs
                    v["kv_cache_usage"] = scheduler_stats.kv_cache_usage
                    v["prefix_cache_queries"] += scheduler_stats.prefix_cache_stats.queries
                    v["prefix_cache_hits"] += scheduler_stats.prefix_cache_stats.hits
                if iteration_stats is not None:
                    v["prompt_tokens"] += iteration_stats.num_prompt_tokens
                    v["generation_tokens"] += iteration_stats.num_generation_tokens

            def log_engine_initialized(self):
                pass

        return TandemStatLogger


class VllmEngine:
    """Implements ``tandem_core.protocol.Engine`` with vLLM."""

    def __init__(self, model: str, source: str, engine_args: dict[str, Any], avoid_worker_cores: bool = True,
                 lora_modules: dict[str, str] | None = None):
        self.model = model
        self.lora_modules = dict(lora_modules or {})  # name -> a local path (built-in ones resolved)
        self.avoid_worker_cores = avoid_worker_cores
        self.source = source
        self.engine_args = dict(engine_args)
        self._llm = None
        self._state = None
        self._totals = _Totals()
        self._active: set[str] = set()  # requests being served (for abort's answer and count)
        self._aborted = 0  # requests aborted before their end (client gone, timeout)
        self._kv_cache_tokens: int | None = None  # the KV cache's capacity, known once started

    async def start(self) -> EngineInfo:
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = build_vllm_args(self.model, self.source, self.engine_args, self.lora_modules)
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
        # Set by the engine core at start-up (its KV blocks); the gateway sizes its prefix index on it.
        cache = vllm_config.cache_config
        self._kv_cache_tokens = (cache.num_gpu_blocks or 0) * (cache.block_size or 0) or None
        supported = await self._llm.get_supported_tasks()
        self._state = State()
        await init_app_state(self._llm, self._state, args, supported)
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
            return _once(invalid("messages: must contain at least one message", param="messages"))
        return self._serve(body, request_id, _with_id(ChatCompletionRequest), "messages",
                           lambda r: self._state.openai_serving_chat.create_chat_completion(r, None))

    def completions(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return self._serve(body, request_id, _with_id(CompletionRequest), "prompt",
                           lambda r: self._state.openai_serving_completion.create_completion(r, None))

    def responses(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """OpenAI's Responses API. ``request_id`` becomes the response's id (vLLM uses the
        request's): the gateway encodes this replica in it, so retrieval finds its store."""
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        return self._serve(body, request_id, _with_id(ResponsesRequest), "input",
                           lambda r: self._responses().create_responses(r, None),
                           dump=_dump_by_alias, events=_response_events)

    def responses_retrieve(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return self._serve(body, request_id, _plain, None,
                           lambda b: self._responses().retrieve_responses(
                               b["response_id"], starting_after=b.get("starting_after"), stream=b.get("stream")),
                           dump=_dump_by_alias, events=_response_events)

    def responses_cancel(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return self._serve(body, request_id, _plain, None,
                           lambda b: self._responses().cancel_responses(b["response_id"]), dump=_dump_by_alias)

    def messages(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """Anthropic's Messages API (the gateway gives its errors Anthropic's shape)."""
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        return self._serve(body, request_id, _body(AnthropicMessagesRequest.model_validate), "messages",
                           lambda r: self._state.anthropic_serving_messages.create_messages(r, None),
                           dump=_dump_without_none)

    def messages_count_tokens(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

        return self._serve(body, request_id, _body(AnthropicCountTokensRequest.model_validate), "messages",
                           lambda r: self._state.anthropic_serving_messages.count_tokens(r, None),
                           dump=_dump_without_none)

    def tokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

        return self._serve(body, request_id, _body(TypeAdapter(TokenizeRequest).validate_python), "prompt",
                           lambda r: self._state.serving_tokenization.create_tokenize(r, None))

    def detokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        return self._serve(body, request_id, _body(DetokenizeRequest.model_validate), "tokens",
                           lambda r: self._state.serving_tokenization.create_detokenize(r, None))

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
                yield _validation_error(e)
                return
            except Exception as e:  # noqa: BLE001 - vLLM raises some request errors; map them as its server does
                result = create_error_response(e)
            if isinstance(result, ErrorResponse):
                err = _from_vllm_error(result)
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
                    yield _from_vllm_error(create_error_response(e))  # framed by the gateway for its route
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
            raise _validation_error(e) from None
        if isinstance(result, ErrorResponse):
            raise _from_vllm_error(result)
        return result

    async def stats(self) -> EngineStats:
        if self._llm is None:
            return EngineStats(running=0)
        running = self._llm.output_processor.get_num_unfinished_requests()
        extra = {**self._totals.values, "aborted": self._aborted, "kv_cache_tokens": self._kv_cache_tokens}
        return EngineStats(running=running, waiting=extra.pop("waiting"), extra=extra,
                           progress=extra["prompt_tokens"] + extra["generation_tokens"])

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


def create_engine(cfg, source_path: str) -> VllmEngine:
    """The ``autoregressive`` entry in ``workers.registry``."""
    return VllmEngine(cfg.name, source_path, cfg.engine_args, lora_modules=cfg.lora_modules)
