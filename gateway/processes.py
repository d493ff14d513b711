"""Several gateway processes on one host, sharing one port and the same replicas
(``gateway.processes: N``, ``tandem serve --processes N``).

The parent binds the listening socket once and starts N gateway processes that inherit it (as
uvicorn's ``--workers`` does), rather than N sockets with ``SO_REUSEPORT``: connections wait in
one accept queue, so a gateway process that dies leaves the connections it had not accepted yet
to the others (with ``SO_REUSEPORT`` the kernel had already hashed them to the dead socket's
queue, and they are reset); an idle process accepts first, where the kernel's hash ignores
load; no other program of the same user can join the port; port 0 is resolved once.

The parent serves no request. It owns the replicas (``RayDeployment`` role ``owner``: named
actors in the ``tandem`` namespace), supervises them (health, restarts: the only process that
does), serves the metrics port if one is configured, restarts a gateway process that died, and
on SIGTERM (or SIGINT) sends SIGTERM to every gateway process, waits until each has drained
(up to ``gateway.drain_timeout_s``), then shuts the replicas down.

Each gateway process attaches to the owner's actors by name (role ``attached``), opens its own
channel to each and serves requests; it fails a dead replica's requests at once and takes it
out of rotation (its channel breaks), and waits for the owner to bring it back. On several
nodes, ``tandem serve --attach`` on each other node runs the same attached code path against
the cluster (``ray.address``).

Shared between the processes: per-key rate limits (``gateway/admission/shared_limits.py``, a file mapped
in memory by every process), admission (``gateway/admission/shared.py``: each model's slots, its
tenants' fair shares, who waits first) and metrics (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tandem_core.config import TandemConfig
from tandem_core.protocol import Role

logger = logging.getLogger(__name__)

RESPAWN_BACKOFF_S = (1.0, 30.0)
STOP_MARGIN_S = 15.0  # beyond the drain: uvicorn's own graceful shutdown, the process exit


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM (and drains) if the parent dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_main(config: TandemConfig, make_deployment: Callable[..., Any], sock: socket.socket, index: int,
               log_level: str, access_log: bool, log_format: str, shared_limits_path: str | None,
               shared_admission_path: str | None, replacement: bool = False) -> None:
    """One gateway process: attach to the owner's replicas, serve on the inherited socket. A
    ``replacement`` (of a process that died) accepts connections only once its replicas are
    ready: the live processes take them meanwhile."""
    _die_with_parent()
    from gateway.observability.logs import setup_logging

    setup_logging(log_level, log_format, access_log=access_log, prefix={"gateway_process": index},
                  text_format=f"%(asctime)s %(levelname)s [gw{index} %(process)d] %(name)s: %(message)s")
    from gateway.http.app import build_app
    from gateway.http.server import run_server
    from gateway.serving.service import Service

    service = Service(config, make_deployment(config, role=Role.ATTACHED), ready_before_serving=replacement)
    if shared_admission_path is not None:
        from gateway.admission.shared import share_admission

        share_admission(service.router, config, shared_admission_path, index)
    app = build_app(service)
    if shared_limits_path is not None:
        from gateway.admission.shared_limits import share

        share(app.state.limiter, shared_limits_path)
    run_server(app, service, log_level=log_level, sockets=[sock])


class ProcessGroup:
    """The parent's side: N gateway processes, restarted when one dies, stopped with a drain."""

    def __init__(self, config: TandemConfig, make_deployment: Callable[..., Any], sock: socket.socket,
                 log_level: str, access_log: bool, log_format: str, shared_limits_path: str | None,
                 shared_admission_path: str | None):
        self.config = config
        self.n = config.gateway.processes
        self._args = (config, make_deployment, sock)
        self._rest = (log_level, access_log, log_format, shared_limits_path, shared_admission_path)
        self._ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = [None] * self.n
        self._started_at = [0.0] * self.n
        self._backoff = [RESPAWN_BACKOFF_S[0]] * self.n
        self.stopping = False

    def spawn(self, i: int, replacement: bool = False) -> None:
        p = self._ctx.Process(target=child_main, args=(*self._args, i, *self._rest, replacement),
                              name=f"tandem-gateway-{i}")
        p.start()
        self.procs[i], self._started_at[i] = p, time.monotonic()
        logger.info("gateway process %d: pid %d", i, p.pid)
        asyncio.get_running_loop().add_reader(p.sentinel, self._exited, i, p)

    def start(self) -> None:
        for i in range(self.n):
            self.spawn(i)

    def _exited(self, i: int, p) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(p.sentinel)
        p.join()
        from gateway.observability.metrics import mark_process_dead

        mark_process_dead(p.pid)
        if self.stopping:
            return
        logger.error("gateway process %d (pid %d) exited (code %s): starting another", i, p.pid, p.exitcode)
        lived = time.monotonic() - self._started_at[i]
        self._backoff[i] = RESPAWN_BACKOFF_S[0] if lived > RESPAWN_BACKOFF_S[1] else \
            min(self._backoff[i] * 2, RESPAWN_BACKOFF_S[1])
        delay = 0.0 if lived > RESPAWN_BACKOFF_S[1] else self._backoff[i]
        loop.call_later(delay, lambda: None if self.stopping else self.spawn(i, replacement=True))

    async def stop(self) -> None:
        """SIGTERM to each: each drains (up to drain_timeout_s) and exits; then the stragglers are killed."""
        self.stopping = True
        live = [p for p in self.procs if p is not None and p.is_alive()]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.gateway.drain_timeout_s + STOP_MARGIN_S
        for p in live:
            await asyncio.to_thread(p.join, max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                logger.warning("gateway process pid %d did not stop in time: killed", p.pid)
                p.kill()
                await asyncio.to_thread(p.join, 5)


def serve_processes(config: TandemConfig, make_deployment: Callable[..., Any], owner: bool = True,
                    log_level: str = "info", access_log: bool = False, log_format: str = "text") -> int:
    """Run ``config.gateway.processes`` gateway processes (see the module's docstring). ``owner``:
    this parent creates and supervises the replicas; else (``--attach``) they are another
    ``tandem serve``'s, and the parent only runs the gateway processes. ``make_deployment(config,
    role=...)`` builds a ``RayDeployment`` (picklable: the gateway processes call it too)."""
    workdir = tempfile.mkdtemp(prefix="tandem-gateway-")
    try:
        return asyncio.run(_parent(config, make_deployment, owner, log_level, access_log, log_format, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _parent(config: TandemConfig, make_deployment, owner: bool, log_level: str, access_log: bool,
                  log_format: str,
                  workdir: str) -> int:
    from gateway.admission.shared import create_shared_admission
    from gateway.admission.shared_limits import create_shared_limits
    from gateway.observability.metrics import use_multiprocess_dir
    from gateway.serving.service import Service

    # The port first, before Ray starts its own processes (any of which may take a free port): a
    # port in use fails here, in one line, and nothing else can take it meanwhile.
    try:
        sock = bind_socket(config.gateway.host, config.gateway.port)
    except OSError as e:
        logger.error("tandem: cannot listen on %s:%d: %s", config.gateway.host, config.gateway.port, e.strerror or e)
        return 2
    deployment = make_deployment(config, role=Role.OWNER) if owner else None  # starts a local Ray
    # After Ray started its own processes (they use prometheus_client too), before any metric of
    # ours exists; the gateway processes inherit it.
    metrics_dir = os.path.join(workdir, "metrics")
    os.mkdir(metrics_dir)
    use_multiprocess_dir(metrics_dir)
    service = None
    stop = asyncio.Event()
    if deployment is not None:
        service = Service(config, deployment)
        service.stop_serving = stop.set  # service.fatal: exit 2 below
        await service.start()
        address = deployment.gcs_address()
        config = config.model_copy(update={"ray": config.ray.model_copy(update={"address": address})})
    metrics_server = None
    if service is None and config.metrics.port is not None:  # attached: this host's processes' metrics
        from prometheus_client import CollectorRegistry, multiprocess

        from gateway.observability.metrics_server import serve_metrics

        registry = CollectorRegistry(auto_describe=True)
        multiprocess.MultiProcessCollector(registry, path=metrics_dir)
        metrics_server = serve_metrics(config.metrics.port, config.metrics.host, registry)
    limits_path = create_shared_limits(config, workdir)
    admission_path = create_shared_admission(config, workdir)
    group = ProcessGroup(config, make_deployment, sock, log_level, access_log, log_format, limits_path,
                         admission_path)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host, port = sock.getsockname()[:2]
    logger.info("tandem: %d gateway processes on http://%s:%d/v1 (one socket, shared replicas)", group.n, host, port)
    try:
        group.start()
        await stop.wait()
        logger.info("stopping: every gateway process drains (up to %.0f s)", config.gateway.drain_timeout_s)
        await group.stop()
    finally:
        sock.close()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        if service is not None:
            await service.stop()
    if service is not None and service.fatal:
        logger.error("tandem: %s", service.fatal)
        return 2
    return 0
