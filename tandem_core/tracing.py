"""Where spans go, and the trace context a replica continues (OpenTelemetry; imported lazily, so
nothing of it loads while tracing is off).

- ``endpoint_of(cfg)``: the configured OTLP endpoint, else the standard environment variables'.
- ``exporter_for(endpoint)``: OTLP over HTTP/protobuf, or gRPC for ``grpc://HOST:PORT``.
- ``vllm_exporter(endpoint)``: the same endpoint as vLLM's ``--otlp-traces-endpoint`` and its
  ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` say it (vLLM's exporter takes the URL as given).
- In a replica: ``configure(settings)`` once (the gateway's ``replica_settings``), then
  ``tracer()`` (None: off); ``TRACE`` holds, in each request's task, the W3C context (a carrier
  dict) its engine's spans continue: the replica's span of that request.
"""

from __future__ import annotations

import contextvars
import os
import time

TRACE: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("tandem_trace", default=None)
_tracer = None  # the replica process's tracer (``configure``), None: off
_settings: dict | None = None  # what it was configured with (engines that export spans of their own read it)


def endpoint_of(cfg) -> str | None:
    """The traces' endpoint: the config's (``ObservabilityConfig``), else the standard variables'."""
    return (cfg.otlp_traces_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _http_url(endpoint: str) -> str:
    return endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"


def exporter_for(endpoint: str):
    if endpoint.startswith("grpc://"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint="http://" + endpoint.removeprefix("grpc://"), insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=_http_url(endpoint))


def vllm_exporter(endpoint: str) -> tuple[str, str]:
    """(vLLM's ``otlp_traces_endpoint``, its ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``)."""
    if endpoint.startswith("grpc://"):
        return "http://" + endpoint.removeprefix("grpc://"), "grpc"
    return _http_url(endpoint), "http/protobuf"


def replica_settings(cfg) -> dict | None:
    """What a replica needs to trace (sent to it at creation): None when tracing is off."""
    endpoint = endpoint_of(cfg)
    return None if endpoint is None else {"endpoint": endpoint, "sample_ratio": cfg.sample_ratio}


def configure(settings: dict | None, service: str = "tandem-replica", exporter=None) -> None:
    """The replica process's tracer (once, before its engine starts). ``exporter``: tests'."""
    global _tracer, _settings
    _settings = settings
    if settings is None and exporter is None:
        _tracer = None
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    ratio = (settings or {}).get("sample_ratio", 1.0)
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter) if exporter is not None else
                                BatchSpanProcessor(exporter_for(settings["endpoint"])))
    _tracer = provider.get_tracer("tandem.replica")


def tracer():
    return _tracer


def settings() -> dict | None:
    return _settings


def parent_of(carrier: dict[str, str] | None):
    """The OpenTelemetry context a W3C carrier names (None: a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier or {})


def carrier_of(span) -> dict[str, str]:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


_EPOCH_NS = time.time_ns() - time.monotonic_ns()  # one offset: instants converted keep their order


def epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` instant as the epoch nanoseconds a span's times are in."""
    return _EPOCH_NS + int(monotonic_s * 1e9)
