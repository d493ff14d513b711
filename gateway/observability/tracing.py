"""Traces of requests (OpenTelemetry), off by default and free when off (``Service.tracing`` is
None: no span object is built).

Per request, parent to child:
- the request's span (kind SERVER; INTERNAL for a batch line), continuing the caller's W3C
  ``traceparent`` (the record's ``trace``) or starting a trace; named ``{operation} {model}`` with
  the GenAI semantic conventions' attributes (``gen_ai.operation.name``, ``gen_ai.provider.name``,
  the request settings, then usage, finish reasons and the response id; ``error.type`` on failure);
- ``admission``: the wait for a replica slot (priority, tenant, queue time);
- ``attempt``: each try on a replica (its id); a failover retry is a second attempt, the first
  one marked with its error. Its context travels to the replica in ``EngineRequest.trace``.

The exporter is OTLP over HTTP/protobuf, or gRPC for a ``grpc://`` endpoint; the SDK honours the
standard ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, certificates).
"""

from __future__ import annotations

from tandem_core.tracing import endpoint_of, exporter_for

OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat", "messages": "chat",
              "embeddings": "embeddings"}
SETTINGS = {"max_tokens": "gen_ai.request.max_tokens", "max_completion_tokens": "gen_ai.request.max_tokens",
            "max_output_tokens": "gen_ai.request.max_tokens", "temperature": "gen_ai.request.temperature",
            "top_p": "gen_ai.request.top_p", "seed": "gen_ai.request.seed", "stream": "gen_ai.request.stream"}


def make_tracing(cfg, exporter=None) -> Tracing | None:
    """A ``Tracing`` when an endpoint is set (or ``exporter`` given: tests), else None."""
    endpoint = endpoint_of(cfg)
    if exporter is None and endpoint is None:
        return None
    return Tracing(cfg, exporter or exporter_for(endpoint))


class Tracing:
    def __init__(self, cfg, exporter, batch: bool = True):
        """``batch``: export from a background thread in batches (False: at each span's end, for tests)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.capture_content = cfg.capture_content
        self.provider = TracerProvider(resource=Resource.create({"service.name": "tandem"}),
                                       sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tandem.gateway")
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        self.provider.shutdown()  # (flushes what is left)

    def request_span(self, env, kind: str, internal: bool = False):
        """The request's span, started (the caller ends it with ``finish``); ``kind``: its model's
        (``ModelKind`` value)."""
        from opentelemetry.trace import SpanKind

        operation = OPERATIONS.get(env.route, env.route)
        parent = self.propagator.extract(env.trace or {})
        attrs = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "vllm" if kind != "diffusion" else
                 "tandem", "gen_ai.request.model": str(env.model), "tandem.request_id": env.request_id,
                 "tandem.priority": env.claim.priority, "tandem.tenant": env.claim.tenant}
        for field, name in SETTINGS.items():
            value = env.body.get(field)
            if isinstance(value, bool | int | float) and name not in attrs:
                attrs[name] = value
        if self.capture_content:
            prompt = env.body.get("messages", env.body.get("prompt", env.body.get("input")))
            attrs["gen_ai.input.messages"] = _text(prompt)
        return self.tracer.start_span(f"{operation} {env.model}", context=parent, attributes=attrs,
                                      kind=SpanKind.INTERNAL if internal else SpanKind.SERVER)

    def start_child(self, parent, name: str, **attrs):
        from opentelemetry import trace

        return self.tracer.start_span(name, context=trace.set_span_in_context(parent), attributes=attrs)

    def context_of(self, span) -> dict[str, str]:
        """``span``'s W3C context (for the replica: ``EngineRequest.trace``)."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def finish(self, span, answer: dict | None = None, stats: dict | None = None, error=None) -> None:
        """End the request's span with what the client got: usage, finish reasons, response id, or
        the error."""
        from opentelemetry.trace import Status, StatusCode

        if not span.is_recording():  # not sampled (an unsampled parent, the sample ratio)
            span.end()
            return
        if answer is not None:
            span.set_attribute("gen_ai.response.id", str(answer.get("id", "")))
            reasons = [c.get("finish_reason") for c in answer.get("choices") or () if c.get("finish_reason")]
            if reasons:
                span.set_attribute("gen_ai.response.finish_reasons", reasons)
            _usage(span, answer.get("usage"))
            if self.capture_content:
                span.set_attribute("gen_ai.output.messages", _text(answer.get("choices") or answer.get("output")))
        stats = stats or {}
        if answer is None and self.capture_content and stats.get("output_text"):  # a chat or completions stream's
            span.set_attribute("gen_ai.output.messages", _text([{"index": i, "text": t} for i, t in
                                                                sorted(stats["output_text"].items())]))
        if stats.get("prompt_tokens") is not None:
            span.set_attribute("gen_ai.usage.input_tokens", stats["prompt_tokens"])
        if stats.get("completion_tokens") is not None:
            span.set_attribute("gen_ai.usage.output_tokens", stats["completion_tokens"])
        if stats.get("finish_reasons"):  # a stream's (``generate._chunk_observer``)
            span.set_attribute("gen_ai.response.finish_reasons", stats["finish_reasons"])
        if stats.get("ttft_s") is not None and (span.attributes or {}).get("gen_ai.request.stream"):
            span.set_attribute("gen_ai.response.time_to_first_chunk", stats["ttft_s"])
        if error is not None:
            span.set_attribute("error.type", getattr(getattr(error, "kind", None), "value", type(error).__name__))
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()


def _usage(span, usage) -> None:
    if not isinstance(usage, dict):
        return
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    output = usage.get("completion_tokens", usage.get("output_tokens"))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    if prompt is not None:
        span.set_attribute("gen_ai.usage.input_tokens", prompt)
    if output is not None:
        span.set_attribute("gen_ai.usage.output_tokens", output)
    if details.get("cached_tokens") is not None:
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", details["cached_tokens"])


def _text(value) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)[:65536]


def note_stream_text(texts: dict[int, str], chunk: str) -> None:
    """A chat or completions chunk's text, added to its choice's: a stream's output, for its span
    when ``capture_content`` is on (``generate._chunk_observer`` feeds it)."""
    import json

    for line in chunk.splitlines():
        if not line.startswith("data: {"):
            continue
        try:
            choices = json.loads(line[6:]).get("choices") or ()
        except ValueError:
            continue
        for c in choices:
            piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
            if isinstance(piece, str):
                texts[c.get("index", 0)] = texts.get(c.get("index", 0), "") + piece
