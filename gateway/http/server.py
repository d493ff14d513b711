"""Run the gateway's app under uvicorn, with a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket

import uvicorn

from gateway.serving.service import Service


def run_server(app, service: Service, log_level: str = "info",
               sockets: list[socket.socket] | None = None) -> None:
    """uvicorn, with a graceful SIGTERM: /ready turns 503, new requests are refused (503), the
    requests in flight finish (up to gateway.drain_timeout_s), then the process exits 0.
    ``sockets``: listen on these (inherited from the parent of several gateway processes)
    instead of binding gateway.host:port."""
    class DrainingServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and self.started and not self.draining:
                self.draining = True
                loop = asyncio.get_event_loop()
                loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))
                return
            super().handle_exit(sig, frame)  # a second signal, or SIGINT: uvicorn's own exit

        async def _drain(self):
            await service.drain()
            self.should_exit = True

    gw = service.config.gateway
    # uvicorn's own logging config off: its loggers go through the root's handler (text or JSON,
    # ``gateway.observability.logs``); its access log off: the gateway writes one line per request itself.
    config = uvicorn.Config(app, host=gw.host, port=gw.port, log_level=log_level.lower(), access_log=False,
                            log_config=None, timeout_graceful_shutdown=5)
    server = DrainingServer(config)
    service.stop_serving = lambda: setattr(server, "should_exit", True)  # service.fatal: the caller exits 2
    server.run(sockets=sockets)
