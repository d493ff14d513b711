"""The request path of the generation routes: read the body once (``gateway.intake``) and check
it, take a slot on a replica (queueing, deadlines, the request timeout), run it there, retry once
elsewhere if that replica fails before the first byte, and answer: one JSON body, or a stream of
SSE events.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.intake import Intake, parse_json, take_in
from gateway.limits import check_limits
from gateway.metrics import now
from gateway.replicas import Replica
from gateway.router import NO_CLAIM, Claim, ModelPool, Slot, request_cost
from gateway.service import Service
from gateway.streaming import ClientGone, event_body, sse_body, until_disconnect
from tandem_core.errors import ErrorKind, TandemError, invalid, request_timeout
from tandem_core.protocol import DONE_ROUTES, ROUTE_SPECS, route_not_served

logger = logging.getLogger(__name__)


def request_id_of(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "unknown"


def engine_request_id(request: Request, route: str) -> str:
    """The engine's id of a request: its route and request id, plus a random suffix when the
    client chose the id (two requests may carry the same one; an engine's ids must differ)."""
    rid = f"{route}-{request_id_of(request)}"
    return f"{rid}-{uuid.uuid4().hex[:8]}" if getattr(request.state, "request_id_from_client", False) else rid


def key_name_of(request: Request) -> str:
    """For logs: the API key's configured name (never the key), when keys are on."""
    name = getattr(request.state, "tandem_key_name", None)
    return f", key {name}" if name else ""


async def take_in_request(request: Request, service: Service, route: str, body: dict | None = None) -> Intake:
    """Read the request's body once (``gateway.intake``): 400 for bad JSON, a body that is not
    an object or one nested deeper than ``limits.max_json_depth``. ``body``: already built by
    the gateway (routes that take no JSON body), not checked for depth."""
    config = service.config
    max_depth = None
    if body is None:
        max_depth = config.limits.max_json_depth
        body = parse_json(await request.body(), max_depth)
    model = config.model(body.get("model"))
    affinity = model.session_affinity if model is not None else None
    return take_in(body, route, max_depth=max_depth, headers=request.headers,
                   session_header=affinity.header if affinity is not None and affinity.enabled else None,
                   timeout_at=_timeout_at(config.limits.request_timeout_s))


async def generate(request: Request, service: Service, route: str, body: dict | None = None,
                   pin: Replica | None = None) -> Response:
    """Serve one request of ``route`` (``tandem_core.protocol.ROUTES``). ``body``: already parsed
    (routes that take no JSON body); ``pin``: the replica that must serve it (a stored response)."""
    t0 = now()
    metrics = service.metrics
    config = service.config
    intake = await take_in_request(request, service, route, body)
    body, timeout_at = intake.body, intake.timeout_at
    model = metrics.model_label(service.router.aliases.get(intake.model, intake.model))  # an alias: its model's
    request.state.tandem_model = model
    if service.draining:
        raise TandemError(ErrorKind.SHUTTING_DOWN, "the server is shutting down; retry on another instance",
                          retry_after=1)
    key_name = getattr(request.state, "tandem_key_name", None)
    api_key = getattr(request.state, "tandem_key", None)
    if api_key is not None and not api_key.may_use(intake.model):  # as if it did not exist
        raise service.router.not_found(intake.model, api_key.models)
    claim = claim_of(body, api_key, route)
    pool = service.router.pool(intake.model)
    _check_route(pool, route)
    check_limits(intake, config.limits_for(pool.name))
    request.app.state.limiter.check_tokens(getattr(request.state, "tandem_key_name", None), intake)
    cost = request_cost(pool.kind, intake)
    key = intake.session_key
    prefix = pool.prefix_blocks(intake)
    adapter = service.router.adapter(intake.model)
    if pin is None and route == "responses":
        pin = replica_of_response(service, body.get("previous_response_id"), pool.name)
    others = [r.id for r in pool.replicas if pin is not None and r is not pin]
    tried: list[str] = []
    while True:
        waited = now()
        slot = await _acquire(pool, request, timeout_at, cost, key, tried + others, prefix, adapter, claim)
        metrics.queue_wait.labels(model).observe(now() - waited)
        metrics.observe_admitted(model, claim.priority, now() - waited)
        metrics.in_flight.labels(model).inc()
        release = _releaser(pool, slot, metrics, model)
        request_id = (response_id(slot.replica.id) if route == "responses" else engine_request_id(request, route))
        items = slot.replica.handle.generate(route, body, request_id, timeout_at)
        try:
            first = await until_disconnect(request, anext(items))
        except ClientGone:
            logger.info("client went away before %s%s was answered; aborted", request_id, key_name_of(request))
            await items.aclose()
            release()
            return Response(status_code=499)
        except StopAsyncIteration:
            release()
            raise TandemError(ErrorKind.ENGINE_ERROR, "the engine returned nothing") from None
        except TandemError as e:  # raised (the replica failed) or yielded (see below): one answer
            first = e
        except BaseException:
            await items.aclose()
            release()
            raise
        if isinstance(first, TandemError) and pin is None and _retry(first, pool, slot, tried):
            await items.aclose()
            release()
            metrics.retries.labels(model).inc()
            continue
        break
    headers = {REPLICA_HEADER: slot.replica.id}
    if isinstance(first, str):
        metrics.ttft.labels(model).observe(now() - t0)
        if route in DONE_ROUTES:  # the hot path: unchanged
            body_iter = sse_body(first, items, release, _chunk_observer(metrics, model, key_name))
        else:
            body_iter = event_body(first, items, release, route)
        return StreamingResponse(body_iter, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                                   **headers})
    await items.aclose()
    release()
    if isinstance(first, TandemError):
        raise first
    if isinstance(first, dict):  # what the client receives, counted to the model, its key and tenant
        metrics.observe_usage(model, first.get("usage"), key_name)
    return JSONResponse(first, headers=headers)


def _check_route(pool: ModelPool, route: str) -> None:
    """400 naming the route and the model when the model's engine does not serve ``route`` (what
    its started replicas reported; before any has started, the replica itself says the same)."""
    info = next((r.info for r in pool.replicas if r.info is not None and r.info.routes is not None), None)
    if info is not None and route not in info.routes:
        raise route_not_served(route, pool.name, pool.kind, info.routes)


# -- stored responses: the response id names the replica whose store holds it --------------------
# vLLM uses the request's ``request_id`` as the response id; the gateway chooses it as
# ``resp_<hex of the replica id>_<uuid>``. Retrieval, cancel and ``previous_response_id`` then go
# to that replica with no table to keep (nor lose on a gateway restart, nor share between gateways).

def response_id(replica_id: str) -> str:
    return f"resp_{replica_id.encode().hex()}_{uuid.uuid4().hex}"


def replica_of_response(service: Service, rid: object, model: str | None = None) -> Replica | None:
    """The live replica that created response ``rid`` (of ``model`` when given), else None."""
    if not isinstance(rid, str) or not rid.startswith("resp_"):
        return None
    try:
        replica_id = bytes.fromhex(rid.split("_")[1]).decode()
    except (IndexError, ValueError):
        return None
    for replica in service.router.all_replicas():
        if replica.id == replica_id and (model is None or replica.model == model) and replica.state.live:
            return replica
    return None


def response_not_found(rid: str) -> TandemError:
    """vLLM's answer for an unknown response id, word for word."""
    return TandemError(ErrorKind.NOT_FOUND, f"Response with id '{rid}' not found.", "response_id")


async def stored_response(request: Request, service: Service, route: str, response_id_: str, **query) -> Response:
    """GET /v1/responses/{id} and POST .../cancel: served by the replica that created it."""
    replica = replica_of_response(service, response_id_)
    if replica is None:
        request.state.tandem_model = "other"
        raise response_not_found(response_id_)
    body = {"model": replica.model, "response_id": response_id_, **{k: v for k, v in query.items() if v is not None}}
    return await generate(request, service, route, body=body, pin=replica)


def _timeout_at(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s


def claim_of(body: dict, api_key, route: str) -> Claim:
    """The request's priority (its body's vLLM ``priority``, else its key's default, raised to
    the key's ``min_priority``), tenant and weight. A generating request's body then carries the
    priority to the engine (vLLM's priority scheduling; the diffusion scheduler's order)."""
    asked = body.get("priority")
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool)):
        raise invalid("priority: an integer (lower is more urgent)", "priority")
    if api_key is None:
        priority = asked or 0
        claim = Claim(priority) if priority else NO_CLAIM
    else:
        priority = api_key.priority if asked is None else asked
        if api_key.min_priority is not None and priority < api_key.min_priority:
            priority = api_key.min_priority  # raised, never refused
        claim = Claim(priority, api_key.tenant_name, api_key.weight)
    if priority != (asked or 0) and ROUTE_SPECS[route].generates:
        body["priority"] = priority
    return claim


async def _acquire(pool: ModelPool, request: Request, timeout_at: float | None, cost: float, key: str | None,
                   tried: list[str], prefix: tuple[int, ...] = (), adapter: str | None = None,
                   claim: Claim = NO_CLAIM) -> Slot:
    """A slot, waiting in the queue no longer than the client's deadline header nor what is left
    of the request timeout (504 when that is what ran out)."""
    queue_deadline = _deadline(request)
    kw = {"cost": cost, "key": key, "exclude": tried, "prefix": prefix, "adapter": adapter, "claim": claim}
    if timeout_at is None:
        return await pool.acquire(queue_deadline, **kw)
    left = max(0.0, timeout_at - asyncio.get_running_loop().time())
    if queue_deadline is not None and queue_deadline <= left:
        return await pool.acquire(queue_deadline, **kw)
    try:
        return await pool.acquire(left, **kw)
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


def _chunk_observer(metrics, model: str, key_name: str | None):
    last = now()

    def observe(chunk: str) -> None:
        nonlocal last
        t = now()
        metrics.chunk_gap.labels(model).observe(t - last)
        last = t
        metrics.observe_sse(model, chunk, key_name)

    return observe
