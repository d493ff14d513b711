"""What the vLLM engine (``workers/vllm_engine.py``) needs around vLLM's own objects: its
`serve` arguments built as `vllm serve` builds them, its configuration checked as its engine
checks it, its errors in tandem's taxonomy, request parsing and answer dumping for its serving
objects, the serving object behind each route, and its own per-step stats accumulated."""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ValidationError

from tandem_core.errors import EngineConfigError, ErrorKind, TandemError, config_error_line, invalid, kind_for_status
from tandem_core.protocol import Item

MAX_LISTED_ERRORS = 8
_CONTEXT_MARKERS = ("maximum context length", "context length", "max_model_len", "too long")


def build_vllm_args(model: str, source: str, engine_args: dict[str, Any],
                    lora_modules: dict[str, str] | None = None, aliases: list[str] | None = None) -> argparse.Namespace:
    """vLLM's own `serve` defaults, with ``engine_args`` applied on top unchanged;
    ``lora_modules`` (name -> path) as ``--enable-lora --lora-modules name=path ...``; the model's
    name and ``aliases`` as ``--served-model-name``.

    Raises ValueError naming the first key vLLM does not know.
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="tandem-vllm"))
    argv = ["--model", source, "--served-model-name", model, *(aliases or [])]
    if lora_modules:
        argv += ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    args = parser.parse_args(argv)
    # The gateway's admission orders by vLLM's `priority` and passes it on: the engine schedules
    # by it too (with every priority 0 this is first come, first served, as vLLM's default).
    args.scheduling_policy = "priority"
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


def validation_error(err: ValidationError) -> TandemError:
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


def from_vllm_error(resp: Any) -> TandemError:
    """vLLM's ErrorResponse -> TandemError (one place; the gateway maps kinds to HTTP)."""
    info = resp.error
    message = info.message
    kind = kind_for_status(int(info.code))
    if kind is ErrorKind.MODEL_NOT_FOUND and info.param != "model":  # e.g. a response id
        kind = ErrorKind.NOT_FOUND
    if kind is ErrorKind.INVALID_REQUEST and any(m in message.lower() for m in _CONTEXT_MARKERS):
        kind = ErrorKind.CONTEXT_TOO_LONG
    return TandemError(kind, message, info.param)


async def once(item: Item) -> AsyncIterator[Item]:
    yield item


def with_id(request_cls):
    """Parse a body as ``request_cls`` with the gateway's request id (vLLM's ``request_id``)."""
    return lambda body, request_id: request_cls.model_validate({**body, "request_id": request_id})


def body_parser(validate):
    """Parse a body with ``validate`` (a request model without a ``request_id``)."""
    return lambda body, request_id: validate(body)


def passthrough(body: dict, request_id: str) -> dict:
    return body


def dump_by_alias(result: BaseModel) -> dict:
    return result.model_dump(mode="json", by_alias=True)


def dump_without_none(result: BaseModel) -> dict:
    return result.model_dump(mode="json", exclude_none=True)


# The serving object vLLM builds for each route (``init_app_state``; none when the model's tasks
# do not include it: a generative model serves no embeddings, a pooling model no chat).
SERVING = {"chat": "openai_serving_chat", "completions": "openai_serving_completion",
            "responses": "openai_serving_responses", "responses_retrieve": "openai_serving_responses",
            "responses_cancel": "openai_serving_responses", "messages": "anthropic_serving_messages",
            "messages_count_tokens": "anthropic_serving_messages", "tokenize": "serving_tokenization",
            "detokenize": "serving_tokenization", "embeddings": "serving_embedding", "pooling": "serving_pooling",
            "classify": "serving_classification", "score": "serving_scores", "score_v1": "serving_scores",
            "rerank": "serving_scores", "rerank_v1": "serving_scores",
            # (vLLM answers /v1/systemone on every generative model: 501 where it has no read strategy)
            "systemone": "openai_serving_chat", "decisions": "openai_serving_chat"}


async def response_events(events) -> AsyncIterator[str]:
    """Responses API events as SSE, exactly as vLLM's route handler frames them."""
    async for event in events:
        data = event.model_dump_json(indent=None, by_alias=True)
        yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {data}\n\n"


class Totals:
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
