"""The FastAPI app: OpenAI routes, health, readiness. Built by ``build_app(service)``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.config import ModelConfig
from gateway.errors import ErrorKind, TandemError, invalid, request_timeout
from gateway.limits import check_limits
from gateway.metrics import now
from gateway.openapi import request_body_schema
from gateway.router import ModelPool, Slot, request_cost
from gateway.security import SecurityError, install_security
from gateway.service import Service
from gateway.streaming import ClientGone, sse_body, until_disconnect

logger = logging.getLogger(__name__)


def error_response(err: TandemError, request: Request | None = None) -> JSONResponse:
    """The one way an error leaves as HTTP. A 5xx names the request id (never a trace)."""
    if err.status >= 500 and request is not None:
        rid = _request_id(request)
        err = TandemError(err.kind, f"{err.message} (request id: {rid})", err.param, err.retry_after)
    return JSONResponse(err.envelope(), status_code=err.status, headers=err.headers() or None)


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "unknown"


def _key_name(request: Request) -> str:
    """For logs: the API key's configured name (never the key), when keys are on."""
    name = getattr(request.state, "tandem_key_name", None)
    return f", key {name}" if name else ""


async def _read_json(request: Request, max_depth: int) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise invalid(f"the request body is nested deeper than {max_depth} levels") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    if _depth_over(body, max_depth):
        raise invalid(f"the request body is nested deeper than {max_depth} levels")
    return body


def _depth_over(value: object, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(v, dict):
            stack.extend((c, depth + 1) for c in v.values() if isinstance(c, (dict, list)))
        elif isinstance(v, list):
            stack.extend((c, depth + 1) for c in v if isinstance(c, (dict, list)))
    return False


async def _generate(request: Request, service: Service, route: str) -> Response:
    t0 = now()
    metrics = service.metrics
    config = service.config
    body = await _read_json(request, config.limits.max_json_depth)
    model = metrics.model_label(body.get("model"))
    request.state.tandem_model = model
    if service.draining:
        raise TandemError(ErrorKind.SHUTTING_DOWN, "the server is shutting down; retry on another instance",
                          retry_after=1)
    pool = service.router.pool(body.get("model"))
    check_limits(body, config.limits_for(pool.name), route)
    request.app.state.limiter.check_tokens(getattr(request.state, "tandem_key_name", None), body)
    timeout_at = _timeout_at(config.limits.request_timeout_s)
    cost = request_cost(pool.kind, body)
    key = _session_key(request, body, config.model(pool.name))
    request_id = f"{route}-{_request_id(request)}"
    tried: list[str] = []
    while True:
        slot = await _acquire(pool, request, timeout_at, cost, key, tried)
        metrics.in_flight.labels(model).inc()
        release = _releaser(pool, slot, metrics, model)
        items = slot.replica.handle.generate(route, body, request_id, timeout_at)
        try:
            first = await until_disconnect(request, anext(items))
        except ClientGone:
            logger.info("client went away before %s%s was answered; aborted", request_id, _key_name(request))
            await items.aclose()
            release()
            return Response(status_code=499)
        except StopAsyncIteration:
            release()
            raise TandemError(ErrorKind.ENGINE_ERROR, "the engine returned nothing") from None
        except TandemError as e:
            await items.aclose()
            release()
            if _retry(e, pool, slot, tried):
                metrics.retries.labels(model).inc()
                continue
            raise
        except BaseException:
            await items.aclose()
            release()
            raise
        if isinstance(first, TandemError) and _retry(first, pool, slot, tried):
            await items.aclose()
            release()
            metrics.retries.labels(model).inc()
            continue
        break
    if isinstance(first, str):
        metrics.ttft.labels(model).observe(now() - t0)
        return StreamingResponse(sse_body(first, items, release, _chunk_observer(metrics, model)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    await items.aclose()
    release()
    if isinstance(first, TandemError):
        raise first
    metrics.observe_usage(model, first.get("usage"))
    return JSONResponse(first)


def _timeout_at(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s


async def _acquire(pool: ModelPool, request: Request, timeout_at: float | None, cost: float, key: str | None,
                   tried: list[str]) -> Slot:
    """A slot, waiting in the queue no longer than the client's deadline header nor what is left
    of the request timeout (504 when that is what ran out)."""
    queue_deadline = _deadline(request)
    if timeout_at is None:
        return await pool.acquire(queue_deadline, cost=cost, key=key, exclude=tried)
    left = max(0.0, timeout_at - asyncio.get_running_loop().time())
    if queue_deadline is not None and queue_deadline <= left:
        return await pool.acquire(queue_deadline, cost=cost, key=key, exclude=tried)
    try:
        return await pool.acquire(left, cost=cost, key=key, exclude=tried)
    except TandemError as e:
        if e.kind is ErrorKind.QUEUE_TIMEOUT:
            raise request_timeout() from None
        raise


def _releaser(pool: ModelPool, slot: Slot, metrics, model: str):
    """Release the slot once, whichever path ends the request first."""
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            pool.release(slot)
            metrics.in_flight.labels(model).dec()

    return release


def _retry(err: TandemError, pool: ModelPool, slot: Slot, tried: list[str]) -> bool:
    """Retry once, on another replica, a request whose replica failed before its first byte.
    Only replica failures (dead, stuck): an engine's answer about the request itself stands."""
    if err.kind is not ErrorKind.ENGINE_DEAD or tried:
        return False
    tried.append(slot.replica.id)
    if not any(r.id not in tried for r in pool.healthy()):
        return False
    logger.warning("replica %s failed before answering; retrying on another replica", slot.replica.id)
    return True


def _session_key(request: Request, body: dict, model: ModelConfig | None) -> str | None:
    """The session-affinity key: the configured header, else the body's ``user``."""
    if model is None or not model.session_affinity.enabled:
        return None
    key = request.headers.get(model.session_affinity.header) or body.get("user")
    return key if isinstance(key, str) and key else None


DEADLINE_HEADER = "x-tandem-queue-deadline-ms"


def _deadline(request: Request) -> float | None:
    """The client's limit on time spent waiting in the gateway's queue (408 past it)."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise invalid(f"header {DEADLINE_HEADER}: a number of milliseconds is required", DEADLINE_HEADER) from None
    if not ms > 0:
        raise invalid(f"header {DEADLINE_HEADER}: must be positive", DEADLINE_HEADER)
    return ms / 1000.0


def _chunk_observer(metrics, model: str):
    last = now()

    def observe(chunk: str) -> None:
        nonlocal last
        t = now()
        metrics.chunk_gap.labels(model).observe(t - last)
        last = t
        metrics.observe_sse(model, chunk)

    return observe


class MetricsMiddleware:
    """Gives every request an id (``X-Request-Id``), counts it by (model, route template, status
    class) and times generations. Outermost: refusals at the edge (401, 413, 429) count too."""

    def __init__(self, app, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = now()
        status = 500
        rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid  # in every answer, and in logs of its failures

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            m = self.service.metrics
            model = (scope.get("state") or {}).get("tandem_model", "other")
            m.observe_request(model, m.route_label(scope), status, now() - t0)


def build_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="tandem", version="0.1.0", lifespan=lifespan,
                  description="One OpenAI-compatible gateway for autoregressive (vLLM) and block-diffusion LLMs.")
    app.state.service = service
    cfg = service.config

    def on_reject(scope, err: SecurityError) -> None:
        service.metrics.observe_rejected("other", err.kind)

    app.state.limiter = install_security(app, cfg.auth, cfg.limits, cfg.cors, base_dir=cfg.config_dir,
                                         on_reject=on_reject)
    app.add_middleware(MetricsMiddleware, service=service)  # added last: outermost

    @app.exception_handler(TandemError)
    async def _tandem_error(request: Request, exc: TandemError):
        model = getattr(request.state, "tandem_model", None)
        if model is None:
            model = "other"
            request.state.tandem_model = model
        service.metrics.observe_rejected(model, exc.kind)
        if exc.status >= 500:
            logger.warning("request %s%s failed: %s", _request_id(request), _key_name(request), exc.message)
        return error_response(exc, request)

    @app.exception_handler(SecurityError)
    async def _security_error(request: Request, exc: SecurityError):
        service.metrics.observe_rejected(getattr(request.state, "tandem_model", None) or "other", exc.kind)
        return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers() or None)

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
                         _request_id(request), _key_name(request))
        return error_response(TandemError(ErrorKind.INTERNAL, "internal server error"), request)

    models = [m.name for m in cfg.models]

    @app.post("/v1/chat/completions", openapi_extra=request_body_schema("chat", models, cfg.limits))
    async def chat_completions(request: Request) -> Response:
        """Chat completion (OpenAI's API): streamed as server-sent events with `stream: true`."""
        return await _generate(request, service, "chat")

    @app.post("/v1/completions", openapi_extra=request_body_schema("completions", models, cfg.limits))
    async def completions(request: Request) -> Response:
        """Text completion (OpenAI's API): streamed as server-sent events with `stream: true`."""
        return await _generate(request, service, "completions")

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [service.model_card(name) for name in service.router.pools]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        service.router.pool(model_id)  # 404 in the envelope if unknown
        return service.model_card(model_id)

    if service.config.metrics.port is None:
        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/replicas")
    async def replicas() -> dict:
        """Each replica's state and its engine's own counters (running requests...)."""
        return {"replicas": await service.replica_stats()}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "uptime_s": round(time.monotonic() - service.started_at, 1)}

    @app.get("/ready")
    async def ready() -> Response:
        status = service.readiness()
        return JSONResponse(status, status_code=200 if status["ready"] and not service.draining else 503)

    return app
