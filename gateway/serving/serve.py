"""Serving one request's record, with no HTTP object: ``serve`` checks it, takes a slot on a
replica (queueing, deadlines, the request timeout), runs it there and retries once elsewhere if
that replica fails before the first byte. The HTTP edge (``gateway/http/generate.py``) and a batch
job's runner (``gateway/batches/runner.py``) both call it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from gateway.observability.metrics import now
from gateway.request.envelope import Envelope
from gateway.request.limits import check_limits
from gateway.routing.replicas import Replica
from gateway.routing.router import ModelPool, Slot
from gateway.serving.service import Service
from tandem_core.errors import ErrorKind, TandemError, request_timeout
from tandem_core.protocol import route_not_served

logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client disconnected before the answer was ready (what ``serve``'s ``watch`` raises)."""


def engine_request_id(env: Envelope) -> str:
    """The engine's id of a request: its route and request id, plus a random suffix when the
    client chose the id (two requests may carry the same one; an engine's ids must differ)."""
    rid = f"{env.route}-{env.request_id}"
    return f"{rid}-{uuid.uuid4().hex[:8]}" if env.request_id_from_client else rid


@dataclass(slots=True)
class Answer:
    """What ``serve`` returns: the JSON body (its usage counted), or the stream's first chunk and
    the rest, with ``release`` to call once it ends (the slot it holds)."""

    replica_id: str
    json: dict | None = None
    first: str | None = None
    items: AsyncIterator | None = None
    release: Callable[[], None] | None = None


async def serve(service: Service, env: Envelope, pin: Replica | None = None,
                watch: Callable[[Awaitable], Awaitable] | None = None,
                admit: Callable[[Envelope], None] | None = None, internal: bool = False) -> Answer:
    """Serve one request's record: check it, take a slot on a replica (queueing, deadlines, the
    request timeout), run it there, retry once elsewhere if that replica fails before the first
    byte. Raises a ``TandemError`` for any refusal or failure. ``pin``: the replica that must serve
    it; ``watch``: awaits the first item (racing it against the client leaving: ``ClientGone``);
    ``admit``: the caller's last check once the request is valid (the HTTP edge: the per-key
    token rate limit), before it queues; ``internal``: not a client's request (a batch line),
    for its trace. Traced when ``service.tracing`` is on (``gateway.observability.tracing``)."""
    tracing = service.tracing
    if tracing is None:
        return await _serve(service, env, pin, watch, admit)
    name = service.router.aliases.get(env.model, env.model)
    model_cfg = service.config.model(name) or service.config.model(service.adapters.base_of(name) or "")
    span = tracing.request_span(env, model_cfg.kind.value if model_cfg else "unknown", internal)
    if span.get_span_context().trace_flags.sampled:  # the access line names its trace
        env.stats["trace_id"] = format(span.get_span_context().trace_id, "032x")
    try:
        answer = await _serve(service, env, pin, watch, admit, span)
    except BaseException as e:
        tracing.finish(span, stats=env.stats, error=e)
        raise
    if answer.json is not None:
        tracing.finish(span, answer.json, env.stats)
    else:  # a stream: its span ends with it (its id: the first chunk's)
        found = _ID.search(answer.first or "")
        if found:
            span.set_attribute("gen_ai.response.id", found.group(1))
        release = answer.release

        def release_and_finish() -> None:
            release()
            tracing.finish(span, stats=env.stats)

        answer.release = release_and_finish
    return answer


async def _serve(service: Service, env: Envelope, pin: Replica | None, watch, admit, span=None) -> Answer:
    t0 = now()
    tracing = service.tracing
    metrics = service.metrics
    config = service.config
    route, body = env.route, env.body
    model = metrics.model_label(service.router.aliases.get(env.model, env.model))  # an alias: its model's
    if service.draining:
        raise TandemError(ErrorKind.SHUTTING_DOWN, "the server is shutting down; retry on another instance",
                          retry_after=1)
    if env.key is not None and not env.key.may_use(env.model):  # as if it did not exist
        raise service.router.not_found(env.model, env.key.models)
    pool = service.router.pool(env.model)
    _check_route(pool, route)
    check_limits(env.intake, config.limits_for(pool.name))
    if admit is not None:
        admit(env)
    if pin is None and route == "responses":
        pin = replica_of_response(service, body.get("previous_response_id"), pool.name)
    others = [r.id for r in pool.replicas if pin is not None and r is not pin]
    tried: list[str] = []
    while True:
        waited = now()
        queued = tracing.start_child(span, "admission", **{"tandem.priority": env.claim.priority,
                                                           "tandem.tenant": env.claim.tenant}) if span else None
        try:
            slot = await _acquire(pool, env, tried + others)
        finally:
            if queued is not None:
                queued.set_attribute("tandem.queue_time_s", now() - waited)
                queued.end()
        env.stats["queue_s"] = now() - waited
        env.stats["replica"] = slot.replica.id
        metrics.queue_wait.labels(model).observe(env.stats["queue_s"])
        metrics.observe_admitted(model, env.claim.priority, env.stats["queue_s"])
        metrics.in_flight.labels(model).inc()
        release = _releaser(pool, slot, metrics, model)
        request_id = response_id(slot.replica.id) if route == "responses" else engine_request_id(env)
        attempt = tracing.start_child(span, "attempt", **{"tandem.replica.id": slot.replica.id,
                                                          "tandem.replica.generation": slot.replica.generation,
                                                          "tandem.engine_request_id": request_id}) if span else None
        trace = tracing.context_of(attempt) if attempt is not None else None
        items = slot.replica.handle.generate(env.engine_request(request_id, trace), env.timeout_at)
        try:
            first = await (watch(anext(items)) if watch is not None else anext(items))
        except ClientGone:
            await items.aclose()
            release()
            _end_attempt(attempt, None)
            raise
        except StopAsyncIteration:
            release()
            _end_attempt(attempt, None)
            raise TandemError(ErrorKind.ENGINE_ERROR, "the engine returned nothing") from None
        except TandemError as e:  # raised (the replica failed) or yielded (see below): one answer
            first = e
        except BaseException:
            await items.aclose()
            release()
            _end_attempt(attempt, None)
            raise
        if isinstance(first, TandemError) and pin is None and _retry(first, pool, slot, tried):
            await items.aclose()
            release()
            metrics.retries.labels(model).inc()
            _end_attempt(attempt, first)
            continue
        break
    if attempt is not None:
        if isinstance(first, str):  # a stream: the attempt lasts as long
            release = _then(release, attempt.end)
        else:
            _end_attempt(attempt, first if isinstance(first, TandemError) else None)
    env.stats["ttft_s"] = now() - t0
    if isinstance(first, str):
        metrics.ttft.labels(model).observe(env.stats["ttft_s"])
        return Answer(slot.replica.id, first=first, items=items, release=release)
    await items.aclose()
    release()
    if isinstance(first, TandemError):
        raise first
    if isinstance(first, dict):  # what the client receives, counted to the model, its key and tenant
        metrics.observe_usage(model, first.get("usage"), env.key_name)
        note_usage(env.stats, first.get("usage"))
    return Answer(slot.replica.id, json=first)


def _then(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        then()

    return both


def _end_attempt(attempt, error: TandemError | None) -> None:
    """End an attempt's span (None: not traced), marked with the error that ended it."""
    if attempt is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        attempt.set_attribute("error.type", error.kind.value)
        attempt.set_status(Status(StatusCode.ERROR, error.message))
    attempt.end()


def _check_route(pool: ModelPool, route: str) -> None:
    """400 naming the route and the model when the model's engine does not serve ``route`` (what
    its started replicas reported; before any has started, the replica itself says the same)."""
    info = next((r.info for r in pool.replicas if r.info is not None and r.info.routes is not None), None)
    if info is not None and route not in info.routes:
        raise route_not_served(route, pool.name, pool.kind.value, info.routes)


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


async def _acquire(pool: ModelPool, env: Envelope, exclude: list[str]) -> Slot:
    """A slot (``ModelPool.place``), waiting in the queue no longer than the client's deadline nor
    what is left of the request timeout (504 when that is what ran out)."""
    queue_deadline = env.queue_deadline_s
    if env.timeout_at is None:
        return await pool.place(env, exclude, queue_deadline)
    left = max(0.0, env.timeout_at - asyncio.get_running_loop().time())
    if queue_deadline is not None and queue_deadline <= left:
        return await pool.place(env, exclude, queue_deadline)
    try:
        return await pool.place(env, exclude, left)
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


def note_usage(stats: dict, usage: object) -> None:
    if isinstance(usage, dict):
        stats["prompt_tokens"] = usage.get("prompt_tokens", usage.get("input_tokens"))
        stats["completion_tokens"] = usage.get("completion_tokens", usage.get("output_tokens"))


_ID = re.compile(r'"id": ?"([^"]+)"')
