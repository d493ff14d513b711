"""A real OTLP/HTTP trace receiver, in-process: it decodes what exporters send
(``ExportTraceServiceRequest``, OpenTelemetry's protobuf) and keeps every span, whoever sent
it (the gateway, a replica, vLLM)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    kind: int
    service: str
    attributes: dict
    events: list[str]
    start_ns: int
    end_ns: int


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.paths: list[str] = []
        self.spans: list[Span] = []
        lock = self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    receiver.paths.append(self.path)
                    for rs in request.resource_spans:
                        res = {a.key: _value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            receiver.spans += [Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                                    s.kind, str(res.get("service.name")),
                                                    {a.key: _value(a.value) for a in s.attributes},
                                                    [e.name for e in s.events], s.start_time_unix_nano,
                                                    s.end_time_unix_nano) for s in ss.spans]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]
