"""Serving one request's record, with no HTTP object: ``serve`` checks it, takes a slot on a
replica (queueing, deadlines, the request timeout), runs it there and retries once elsewhere if
that replica fails before the first byte. The HTTP edge (``gateway/http/generate.py``) and a batch
job's runner (``gateway/batches/runner.py``) both call it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from gateway.observability.watch import RequestWatch
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
    for its trace. What it does is reported to a ``RequestWatch`` (metrics, traces, the access
    line's stats)."""
    name = service.router.aliases.get(env.model, env.model)  # an alias: its model's
    kind = "unknown"
    if service.tracing is not None:  # the span's provider
        model_cfg = service.config.model(name) or service.config.model(service.adapters.base_of(name) or "")
        kind = model_cfg.kind.value if model_cfg else "unknown"
    obs = RequestWatch(service.metrics, service.tracing, env, service.metrics.model_label(name), kind, internal)
    try:
        return await _serve(service, env, pin, watch, admit, obs)
    except BaseException as e:
        obs.failed(e)
        raise


async def _serve(service: Service, env: Envelope, pin: Replica | None, watch, admit, obs: RequestWatch) -> Answer:
    route, body = env.route, env.body
    if service.draining:
        raise TandemError(ErrorKind.SHUTTING_DOWN, "the server is shutting down; retry on another instance",
                          retry_after=1)
    if env.key is not None and not env.key.may_use(env.model):  # as if it did not exist
        raise service.router.not_found(env.model, env.key.models)
    pool = service.router.pool(env.model)
    _check_route(pool, route)
    check_limits(env.intake, service.config.limits_for(pool.name))
    if admit is not None:
        admit(env)
    if pin is None and route == "responses":
        pin = replica_of_response(service, body.get("previous_response_id"), pool.name)
    others = [r.id for r in pool.replicas if pin is not None and r is not pin]
    tried: list[str] = []
    while True:
        obs.queued()
        try:
            slot = await _acquire(pool, env, tried + others)
        except BaseException:
            obs.not_admitted()
            raise
        obs.admitted(slot.replica)
        release = _once(partial(pool.release, slot), obs.released)
        request_id = response_id(slot.replica.id) if route == "responses" else engine_request_id(env)
        trace = obs.attempt(slot.replica, request_id)
        items = slot.replica.handle.generate(env.engine_request(request_id, trace), env.timeout_at)
        try:
            first = await (watch(anext(items)) if watch is not None else anext(items))
        except StopAsyncIteration:
            release()
            raise TandemError(ErrorKind.ENGINE_ERROR, "the engine returned nothing") from None
        except TandemError as e:  # raised (the replica failed) or yielded (see below): one answer
            first = e
        except BaseException:  # the client left (ClientGone), a cancel
            await items.aclose()
            release()
            raise
        if isinstance(first, TandemError) and pin is None and _retry(first, pool, slot, tried):
            await items.aclose()
            release()
            obs.retried(first)
            continue
        break
    obs.first(stream=isinstance(first, str))
    if isinstance(first, str):  # a stream: the attempt and the request's span last as long
        obs.streaming(first)
        return Answer(slot.replica.id, first=first, items=items, release=_once(release, obs.stream_ended))
    obs.attempt_ended(first if isinstance(first, TandemError) else None)
    await items.aclose()
    release()
    if isinstance(first, TandemError):
        raise first
    obs.answered(first)
    return Answer(slot.replica.id, json=first)


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


def _once(*steps: Callable[[], None]) -> Callable[[], None]:
    """``steps`` run the first time it is called, never again (a slot is released by whichever
    path ends the request first)."""
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            for step in steps:
                step()

    return once


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
