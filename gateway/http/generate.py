"""The HTTP edge of the generation routes: ``generate`` reads the body once into the request's
record (``gateway.request.envelope``), has it served (``gateway.serving.serve``), and answers: one
JSON body, or a stream of SSE events. 499 when the client leaves before the first byte.
"""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.http.streaming import event_body, sse_body, until_disconnect
from gateway.observability.metrics import now
from gateway.observability.tracing import note_stream_text
from gateway.observability.watch import note_usage
from gateway.request.envelope import Envelope, envelope
from gateway.request.intake import parse_json
from gateway.routing.replicas import Replica
from gateway.serving.serve import ClientGone, replica_of_response, response_not_found, serve
from gateway.serving.service import Service
from tandem_core.errors import invalid
from tandem_core.protocol import DONE_ROUTES

logger = logging.getLogger(__name__)


def request_id_of(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "unknown"


def key_name_of(request: Request) -> str:
    """For logs: the API key's configured name (never the key), when keys are on."""
    name = getattr(request.state, "tandem_key_name", None)
    return f", key {name}" if name else ""


async def envelope_of(request: Request, service: Service, route: str, body: dict | None = None) -> Envelope:
    """The request's record (``gateway.request.envelope``), its body read once: 400 for bad JSON, a body
    that is not an object or one nested deeper than ``limits.max_json_depth``. ``body``: already
    built by the gateway (routes that take no JSON body), not checked for depth."""
    config = service.config
    max_depth = None
    if body is None:
        max_depth = config.limits.max_json_depth
        body = parse_json(await request.body(), max_depth)
    state = request.state
    return envelope(route, body, request_id=request_id_of(request), config=config,
                    key=getattr(state, "tandem_key", None),
                    request_id_from_client=getattr(state, "request_id_from_client", False),
                    max_depth=max_depth, headers=request.headers, queue_deadline_s=_deadline(request))


async def generate(request: Request, service: Service, route: str, body: dict | None = None,
                   pin: Replica | None = None) -> Response:
    """Serve one HTTP request of ``route`` (``tandem_core.protocol.ROUTES``). ``body``: already
    parsed (routes that take no JSON body); ``pin``: the replica that must serve it (a stored
    response). 499 when the client leaves before the first byte."""
    env = await envelope_of(request, service, route, body)
    request.state.tandem_stats = env.stats  # for the access line (``gateway.observability.logs``)
    request.state.tandem_model = service.metrics.model_label(service.router.aliases.get(env.model, env.model))
    try:
        answer = await serve(service, env, pin, lambda first: until_disconnect(request, first),
                             admit=lambda e: request.app.state.limiter.check_tokens(e.key_name, e.intake))
    except ClientGone:
        logger.info("client went away before %s%s was answered; aborted", env.request_id, key_name_of(request))
        return Response(status_code=499)
    headers = {REPLICA_HEADER: answer.replica_id}
    if answer.json is not None:
        return JSONResponse(answer.json, headers=headers)
    metrics, model = service.metrics, request.state.tandem_model
    if route in DONE_ROUTES:  # the hot path: unchanged
        body_iter = sse_body(answer.first, answer.items, answer.release,
                             _chunk_observer(metrics, model, env.key_name, env.stats, service.tracing, answer.first))
    else:
        body_iter = event_body(answer.first, answer.items, answer.release, route)
    return StreamingResponse(body_iter, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                               **headers})


async def stored_response(request: Request, service: Service, route: str, response_id_: str, **query) -> Response:
    """GET /v1/responses/{id} and POST .../cancel: served by the replica that created it."""
    replica = replica_of_response(service, response_id_)
    if replica is None:
        request.state.tandem_model = "other"
        raise response_not_found(response_id_)
    body = {"model": replica.model, "response_id": response_id_, **{k: v for k, v in query.items() if v is not None}}
    return await generate(request, service, route, body=body, pin=replica)


DEADLINE_HEADER = "x-tandem-queue-deadline-ms"
# Which replica answered (after any retry): for operators and tests, never needed by clients.
REPLICA_HEADER = "x-tandem-replica"


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


_FINISH = re.compile(r'"finish_reason": ?"(\w+)"')


def _chunk_observer(metrics, model: str, key_name: str | None, stats: dict, tracing=None, first: str = ""):
    """What follows the stream's ``first`` chunk. Traced: its finish reasons noted too (``stats``,
    for its span), and its text per choice with ``capture_content`` (``first``'s included)."""
    last = now()
    reasons = stats.setdefault("finish_reasons", []) if tracing is not None else None
    texts = stats.setdefault("output_text", {}) if tracing is not None and tracing.capture_content else None
    if texts is not None:
        note_stream_text(texts, first)

    def observe(chunk: str) -> None:
        nonlocal last
        t = now()
        metrics.chunk_gap.labels(model).observe(t - last)
        last = t
        usage = metrics.observe_sse(model, chunk, key_name)
        if usage is not None:
            note_usage(stats, usage)
        if reasons is not None and '"finish_reason"' in chunk:
            reasons.extend(_FINISH.findall(chunk))
        if texts is not None:
            note_stream_text(texts, chunk)

    return observe


