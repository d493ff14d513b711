"""The gateway's running state: its config, router, metrics and replica supervisor, and the
drain on SIGTERM. The supervision itself is ``gateway/fleet/supervisor.py``; what the gateway shows of
its replicas is ``gateway/fleet/views.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.admission.keys import resolve_keys
from gateway.fleet.supervisor import Deployment, Supervisor
from gateway.observability.metrics import Metrics
from gateway.observability.tracing import make_tracing
from gateway.routing.adapters import Adapters
from gateway.routing.router import ModelPool, Router
from tandem_core.config import TandemConfig
from tandem_core.protocol import Role

logger = logging.getLogger(__name__)

READY_WAIT_S = 120.0  # see ``Service.ready_before_serving``


class Service:
    """The deployment's ``role`` says who owns the replicas (``tandem_core.protocol.Role``);
    attached (``gateway/processes.py``), this process serves requests on them but never restarts
    or shuts one down.
    ``ready_before_serving``: ``start`` returns only once every model can serve (up to
    ``READY_WAIT_S``), so that a gateway process started in place of a dead one, sharing the
    listening socket with live ones, takes no connection it could only answer with 503."""

    def __init__(self, config: TandemConfig, deployment: Deployment, ready_before_serving: bool = False,
                 metrics_port: bool | None = None):
        self.config = config
        # Serves ``metrics.port`` (if set): the one process of a host that does (default: the
        # replicas' owner; a lone `tandem serve --attach` too, for its own gateway's metrics)
        self.serves_metrics_port = metrics_port if metrics_port is not None else deployment.role is not Role.ATTACHED
        self.deployment = deployment
        self.ready_before_serving = ready_before_serving
        self.adapters = Adapters(config)  # LoRA adapters on the autoregressive bases
        self.router = Router([
            ModelPool(m.name, m.kind, max_in_flight=m.max_in_flight_per_replica,
                      max_queue=config.gateway.max_queue,
                      affinity_load_factor=m.session_affinity.load_factor if m.session_affinity.enabled else None,
                      routing=m.routing,
                      adapter_slots=int(m.engine_args.get("max_loras", 1)) if m.lora_enabled else None,
                      reserve=config.gateway.priority_reserve, promote_after_s=config.gateway.promote_after_s)
            for m in config.models], self.adapters,
            aliases={alias: m.name for m in config.models for alias in m.aliases})
        self.draining = False
        self.on_drain: list[Callable[[], None]] = []  # told first when the drain begins (the batch runner)
        self.fatal: str | None = None  # why the service stopped at start (a replica's configuration)
        self.started_at = time.monotonic()
        keys = resolve_keys(config.auth, base_dir=config.config_dir) if config.auth.enabled else []
        tenants = {k.name: k.tenant_name for k in keys} if config.auth.enabled else None
        # (the config's loader read the keys already: they resolve)
        if len({k.tenant_name for k in keys}) > 1 and self.deployment.role is not Role.ATTACHED:
            unbounded = [m.name for m in config.models if m.max_in_flight_per_replica is None]
            if unbounded:  # said once, by the process that owns the replicas
                logger.warning("tenants' weights apply when requests queue in the gateway: models %s have no "
                               "max_in_flight_per_replica, so their engines queue every request (priority first, "
                               "then arrival) and the shares do not hold there", ", ".join(unbounded))
        self.metrics = Metrics([m.name for m in config.models] + list(self.adapters.base), tenants,
                               batch_priority=config.batches.priority)
        self.tracing = make_tracing(config.observability)  # None: off (no span is ever built)
        self.supervisor = Supervisor(config, deployment, self.router, self.metrics)
        self.supervisor.on_fatal = self._fatal
        self.supervisor.on_engine_started = self.adapters.on_started
        self.stop_serving: Callable[[], None] | None = None  # set by whoever runs the service
        self._metrics_server = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the one the service runs in

    @property
    def attached(self) -> bool:
        return self.deployment.role is Role.ATTACHED

    async def start(self) -> None:
        """Create every replica and start them in the background; /ready says when they serve."""
        self.started_at = time.monotonic()
        self.loop = asyncio.get_running_loop()
        self.supervisor.start()
        if self.config.metrics.port is not None and self.serves_metrics_port:
            from gateway.observability.metrics_server import serve_metrics

            self._metrics_server = serve_metrics(self.config.metrics.port, self.config.metrics.host,
                                                 self.metrics.exposition)
            logger.info("metrics on http://%s:%d/metrics", self.config.metrics.host, self.config.metrics.port)
        if self.ready_before_serving:
            deadline = time.monotonic() + READY_WAIT_S
            while not self.router.ready() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if not self.router.ready():
                logger.warning("not every model is ready after %.0f s: serving anyway (/ready says which)",
                               READY_WAIT_S)

    def _fatal(self, line: str) -> None:
        """A replica's configuration cannot work: remember why and stop serving (exit 2)."""
        self.fatal = self.fatal or line
        if self.stop_serving is not None:
            self.stop_serving()

    def in_flight(self) -> int:
        return sum(r.outstanding for r in self.router.all_replicas())

    async def drain(self) -> bool:
        """Refuse new requests (and say so in /ready), tell ``on_drain`` (the batch runner starts
        no more lines), wait for in-flight ones (batch lines among them). True if drained."""
        self.draining = True
        for hook in self.on_drain:
            hook()
        deadline = time.monotonic() + self.config.gateway.drain_timeout_s
        logger.info("draining: %d request(s) in flight, up to %.0f s", self.in_flight(),
                    self.config.gateway.drain_timeout_s)
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.in_flight()
        if left:
            logger.warning("drain timeout: %d request(s) still in flight", left)
        return left == 0

    async def stop(self) -> None:
        await self.supervisor.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the spans left, exported
