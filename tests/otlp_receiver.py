"""A real OTLP/HTTP trace receiver, in-process (``tandem_tools.bench.otlp_sink``'s server): it keeps
every span it decodes, whoever sent it (the gateway, a replica, vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem_tools.bench.otlp_sink import Sink


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


class Receiver(Sink):
    def __init__(self):
        super().__init__()
        self.spans: list[Span] = []

    def on_export(self, request) -> None:
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                self.spans += [Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                    str(res.get("service.name")), {a.key: _value(a.value) for a in s.attributes},
                                    [e.name for e in s.events], s.start_time_unix_nano, s.end_time_unix_nano)
                               for s in ss.spans]

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]
