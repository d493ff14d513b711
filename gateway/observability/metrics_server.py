"""The metrics port's own listener (``metrics.port``)."""

from __future__ import annotations


def serve_metrics(port: int, host: str, registry):
    """``/metrics`` of ``registry`` on its own listener (``metrics.port``), in Prometheus's text
    format whatever the scraper's Accept header asks: prometheus_client 0.26 writes OpenMetrics
    sample names with ``:`` turned to ``_`` (``vllm_num_requests_running`` under a
    ``vllm:num_requests_running`` family) for Prometheus 2's Accept header, which would break
    every vLLM dashboard and rule. Returns the server (``shutdown()`` stops it)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
