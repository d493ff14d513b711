"""An OTLP/HTTP trace sink, in-process: answers every export with 200, decodes it
(``ExportTraceServiceRequest``) and hands it to ``on_export`` (the base counts spans: benchmarks
prove a traced run exported; ``tests/otlp_receiver.py`` keeps them)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink:
    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        self.paths: list[str] = []
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                with sink.lock:
                    sink.paths.append(self.path)
                    sink.on_export(request)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def on_export(self, request) -> None:
        """One decoded export (called under ``lock``)."""
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
