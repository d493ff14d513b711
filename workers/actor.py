"""The thin Ray actor shell around one engine (one replica, one GPU).

It owns no serving logic: it builds the engine from the model's config, starts it, runs
requests and sends what they yield back over the caller's channel (``workers/transport/channel.py``).
Errors go back as values. The class is plain Python: ``workers.deployment`` wraps it with
``ray.remote``; unit tests call it in-process.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

from tandem_core import tracing
from tandem_core.config import ModelConfig
from tandem_core.errors import ErrorKind, TandemError, request_timeout
from tandem_core.protocol import (
    Engine,
    EngineInfo,
    EngineRequest,
    EngineStats,
    Item,
    ReplicaHealth,
    route_not_served,
    served_routes,
)
from workers.registry import create_engine
from workers.transport.channel import Batch, Outbox
from workers.transport.socket_channel import ChannelServer

logger = logging.getLogger(__name__)
CHANNEL_WAIT_S = 10.0


class EngineActor:
    def __init__(self, model: dict, source_path: str, replica_id: str, engine_key: str | None = None,
                 engine: Engine | None = None, trace_settings: dict | None = None):
        """``trace_settings``: ``tandem_core.tracing.replica_settings`` (None: tracing off)."""
        self.cfg = ModelConfig.model_validate(model)
        self.replica_id = replica_id
        if trace_settings is not None:  # before the engine exists: engines read it
            tracing.configure(trace_settings)
        self.engine = engine if engine is not None else create_engine(self.cfg, source_path, engine_key)
        self.info: EngineInfo | None = None
        self.incarnation = uuid.uuid4().hex  # a restarted actor runs __init__ again: a new one
        self._channels: dict[str, Outbox] = {}
        # Channels whose gateway renews a lease with each health check (attached gateway
        # processes): id -> (last renewal, lease seconds). A gateway process killed outright
        # cannot close its channel, and Ray does not end the stream of a dead caller: past its
        # lease the channel is closed here and its requests aborted.
        self._leases: dict[str, tuple[float, float]] = {}
        self._channel_opened = asyncio.Condition()  # binds to the loop on first use (3.10+)
        self._starting: asyncio.Future | None = None
        self._socket_server: ChannelServer | None = None  # the channels' TCP listener (open_socket)

    async def start(self) -> EngineInfo:
        """Start the engine once per incarnation; a repeated call (a retried restart) gets the
        same answer instead of a second engine."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> EngineInfo:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logger.info("replica %s (pid %d) starting %s", self.replica_id, os.getpid(), self.cfg.name)
        info = await self.engine.start()
        self.info = dataclasses.replace(info, routes=served_routes(self.engine))
        return self.info

    async def open_channel(self, channel_id: str, lease_s: float | None = None) -> AsyncIterator[Batch]:
        """A long-lived stream of batches for every request submitted on ``channel_id`` (the
        Ray channel, ``GatewayConfig.channel: ray``). ``lease_s``: it lives that long, and as
        long again after each renewal (``health``)."""
        outbox = await self.attach(channel_id, lease_s)
        try:
            async for batch in outbox.stream():
                yield batch
        finally:
            self.detach(channel_id, outbox)

    async def open_socket(self, channel_id: str, lease_s: float | None = None) -> tuple[str, int, bytes]:
        """Where the gateway connects for ``channel_id``'s channel over TCP
        (``GatewayConfig.channel: socket``): (host, port, token). The token, fresh for each call,
        is good for one connection; the channel opens when it connects and ends when either end
        drops the connection. ``lease_s``: as for ``open_channel``. The listening socket starts
        on the first call, on this node's address."""
        if self._socket_server is None:
            self._socket_server = ChannelServer(self, _node_address())
        return await self._socket_server.offer(channel_id, lease_s)

    async def attach(self, channel_id: str, lease_s: float | None = None) -> Outbox:
        """Open ``channel_id``'s outbox (either transport)."""
        outbox = Outbox()
        self._channels[channel_id] = outbox
        if lease_s is not None:
            self._leases[channel_id] = (time.monotonic(), lease_s)
        async with self._channel_opened:
            self._channel_opened.notify_all()
        return outbox

    def detach(self, channel_id: str, outbox: Outbox) -> None:
        """The channel's stream or connection ended: its requests are aborted (nobody reads them)."""
        outbox.close()
        if self._channels.get(channel_id) is outbox:  # not a newer one under the same id
            del self._channels[channel_id]
            self._leases.pop(channel_id, None)

    async def submit(self, channel_id: str, request: EngineRequest) -> None:
        """Start a request; its items (see ``tandem_core.protocol``) go out on the channel."""
        self.submit_on(await self._outbox(channel_id), request)

    def submit_on(self, outbox: Outbox, request: EngineRequest) -> None:
        tracer = tracing.tracer()
        if tracer is None or request.trace is None:
            outbox.start(request.request_id, self._items(request))
            return
        # The replica's span of the request, continuing the gateway's attempt: the engine's own
        # spans (vLLM's llm_request, a diffusion model's blocks) are its children, through
        # ``tracing.TRACE`` in the request's task.
        span = tracer.start_span(f"replica {request.route}", context=tracing.parent_of(request.trace),
                                 attributes={"tandem.replica.id": self.replica_id, "tandem.replica.node": _node_name(),
                                             "tandem.replica.incarnation": self.incarnation,
                                             "tandem.engine_request_id": request.request_id})
        context = contextvars.copy_context()
        if span.is_recording():  # (not sampled: the engine makes no spans of its own either)
            context.run(tracing.TRACE.set, tracing.carrier_of(span))
        outbox.start(request.request_id, _spanned(span, self._items(request)), context=context)

    def _items(self, request: EngineRequest) -> AsyncIterator[Item]:
        route = request.route
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s: %s, priority %d, tenant %s, key %s, trace %s", request.request_id, route,
                         request.priority, request.tenant, request.key, request.trace)
        if request.deadline is not None and time.time() >= request.deadline:  # given up on already
            return _one(request_timeout())
        if route in served_routes(self.engine):  # one engine method per route (tandem_core.protocol)
            return getattr(self.engine, route)(request.body, request.request_id)
        return _one(route_not_served(route, self.cfg.name, self.cfg.kind.value, served_routes(self.engine)))

    async def _outbox(self, channel_id: str) -> Outbox:
        # The caller opens its channel before it submits; tolerate the race anyway.
        if channel_id not in self._channels:
            async with self._channel_opened:
                try:
                    await asyncio.wait_for(self._channel_opened.wait_for(lambda: channel_id in self._channels),
                                           CHANNEL_WAIT_S)
                except TimeoutError:
                    raise TandemError(ErrorKind.ENGINE_ERROR, "the gateway's channel to this replica is not open") \
                        from None
        return self._channels[channel_id]

    async def abort(self, request_id: str) -> bool:
        aborted = any([outbox.abort(request_id) for outbox in self._channels.values()])
        return await self.engine.abort(request_id) or aborted

    async def health(self, channel_id: str | None = None, lease_s: float | None = None) -> ReplicaHealth:
        """Called by the gateway's health loop. Raises if the engine says it cannot serve.
        ``channel_id``, ``lease_s``: that gateway's channel lives ``lease_s`` more seconds."""
        if channel_id is not None and lease_s is not None:
            self._leases[channel_id] = (time.monotonic(), lease_s)
        self._reap_channels()
        in_flight = sum(len(o.tasks) for o in self._channels.values())
        if self.info is None:
            return ReplicaHealth(self.incarnation, started=False, in_flight=in_flight, progress=0)
        await self.engine.check_health()
        stats = await self.engine.stats()
        return ReplicaHealth(self.incarnation, started=True, in_flight=in_flight, progress=stats.progress)

    def _reap_channels(self) -> None:
        now = time.monotonic()
        for cid, (seen, lease) in list(self._leases.items()):
            if now - seen > lease:
                del self._leases[cid]
                outbox = self._channels.get(cid)
                if outbox is not None:
                    logger.warning("replica %s: channel %s not renewed for %.0f s (its gateway is gone): closed, "
                                   "%d request(s) aborted", self.replica_id, cid, now - seen, len(outbox.tasks))
                    err = TandemError(ErrorKind.ENGINE_ERROR, "the gateway's channel to the replica lapsed (no "
                                      f"health check for {now - seen:.0f} s): the request was aborted")
                    for request_id in list(outbox.tasks):
                        outbox.put(request_id, err)
                    outbox.close()
                    del self._channels[cid]  # its stream may never resume to do it: its caller is dead

    def node_id(self) -> str:
        """The Ray node this replica runs on (placement checks, /admin/replicas)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def describe(self) -> dict:
        """Where this replica runs: Ray node, process, incarnation (/admin/replicas, fault tests)."""
        import ray

        node = self.node_id() if ray.is_initialized() else None  # None: in-process (unit tests)
        group = ray.util.get_current_placement_group() if node is not None else None  # TP x PP > 1
        return {"node_id": node, "pid": os.getpid(), "incarnation": self.incarnation,
                "placement_group_id": group.id.hex() if group is not None else None}

    async def stats(self) -> EngineStats:
        """The engine's stats, plus the requests in flight here: in total and per channel (each
        gateway process has its own channel: what the others put on this replica is its load)."""
        s = await self.engine.stats()
        per_channel = {cid: len(o.tasks) for cid, o in self._channels.items()}
        return EngineStats(running=s.running, waiting=s.waiting,
                           extra={**s.extra, "actor_in_flight": sum(per_channel.values()),
                                  "channel_in_flight": per_channel})

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def lora(self, op: str, body: dict) -> str:
        """Load or unload a LoRA adapter in the engine (``tandem_core.protocol.Engine``)."""
        if not callable(getattr(self.engine, "lora", None)):
            raise TandemError(ErrorKind.INVALID_REQUEST, f"model {self.cfg.name!r} (kind: {self.cfg.kind.value}) "
                              "takes no LoRA adapters", "model")
        return await self.engine.lora(op, body)

    async def shutdown(self) -> None:
        if self._socket_server is not None:
            self._socket_server.close()
        for outbox in list(self._channels.values()):
            outbox.close()  # a socket channel's connection closes with it
        await self.engine.shutdown()

    def cut_off(self) -> None:
        """What a killed process loses, in this process (an in-process replica replaced: unit
        tests): its listener and connections cut without another byte, its channels closed."""
        if self._socket_server is not None:
            self._socket_server.close(drop=True)
        for outbox in list(self._channels.values()):
            outbox.close()


def _node_name() -> str:
    import socket

    return socket.gethostname()


async def _spanned(span, items: AsyncIterator[Item]) -> AsyncIterator[Item]:
    """``items``, the span ended after the last (marked with an error item's kind)."""
    failed = None
    try:
        async for item in items:
            if isinstance(item, TandemError):
                failed = item
            yield item
    finally:
        if failed is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_attribute("error.type", failed.kind.value)
            span.set_status(Status(StatusCode.ERROR, failed.message))
        span.end()


def _node_address() -> str:
    """Where this actor's channel socket listens: its Ray node's address (a gateway on another
    node reaches it), or the loopback when not under Ray (unit tests)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


async def _one(item: Item) -> AsyncIterator[Item]:
    yield item
