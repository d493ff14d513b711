"""Traces of requests (issue 35, ``gateway/tracing.py``) on fake engines, into an in-memory
exporter: the request's span continues the client's `traceparent`, has the GenAI attributes and
the usage the client received; admission and attempt spans are its children; the attempt's
context crosses the hop in the request record; a failure is marked; off by default."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.tracing import Tracing
from tandem_core.config import ObservabilityConfig
from tests.unit.gateway_server import fake_gateway

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


@pytest.fixture()
def traced():
    exporter = InMemorySpanExporter()
    with fake_gateway({"num_tokens": 3}) as (url, service, deployment):
        assert service.tracing is None  # off by default
        service.tracing = Tracing(ObservabilityConfig(), exporter, batch=False)
        sent = []
        for replica in service.router.all_replicas():
            call = replica.handle.call

            async def spy(method, *args, call=call):
                if method == "submit":
                    sent.append(args[-1])
                return await call(method, *args)
            replica.handle.call = spy
        yield url, exporter, sent
        service.tracing = None


def _by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_request_is_one_trace_continuing_the_clients(traced):
    url, exporter, sent = traced
    r = httpx.post(url + "/v1/chat/completions", headers={"traceparent": TRACEPARENT}, timeout=30,
                   json={"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                         "temperature": 0})
    assert r.status_code == 200
    spans = _by_name(exporter)
    request, admission, attempt = spans["chat fake"], spans["admission"], spans["attempt"]
    assert format(request.context.trace_id, "032x") == TRACE_ID and format(request.parent.span_id, "016x") == PARENT
    assert request.kind.name == "SERVER"
    for child in (admission, attempt):
        assert child.parent.span_id == request.context.span_id and child.context.trace_id == request.context.trace_id
    a = request.attributes
    usage = r.json()["usage"]
    assert (a["gen_ai.operation.name"], a["gen_ai.provider.name"], a["gen_ai.request.model"]) == ("chat", "vllm", "fake")
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (3, 0)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (usage["prompt_tokens"],
                                                                                  usage["completion_tokens"])
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",) and a["gen_ai.response.id"] == r.json()["id"]
    assert attempt.attributes["tandem.replica.id"] == "fake/0"
    # The replica gets the attempt's context (to continue the trace there).
    (req,) = sent
    assert req.trace["traceparent"].split("-")[1:3] == [TRACE_ID, format(attempt.context.span_id, "016x")]


def test_a_stream_span_ends_with_the_stream_and_a_failure_is_marked(traced):
    url, exporter, _ = traced
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as s:
        lines = list(s.iter_lines())
    assert "data: [DONE]" in lines
    spans = _by_name(exporter)
    stream = spans["chat fake"]
    assert stream.attributes["gen_ai.request.stream"] is True and stream.parent is None  # a new trace
    assert stream.attributes["gen_ai.response.time_to_first_chunk"] >= 0
    exporter.clear()
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": -1}, timeout=30)
    assert r.status_code == 400
    (failed,) = [s for s in exporter.get_finished_spans() if s.name == "text_completion fake"]
    assert failed.status.status_code.name == "ERROR" and failed.attributes["error.type"] == "invalid_request"


def test_spans_reach_an_otlp_http_receiver():
    """The real exporter (OTLP over HTTP/protobuf, batched) to a receiver decoding what it gets."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from gateway.tracing import make_tracing

    got: list = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with fake_gateway({"num_tokens": 2}) as (url, service, _):
            endpoint = f"http://127.0.0.1:{server.server_address[1]}"
            service.tracing = make_tracing(ObservabilityConfig(otlp_traces_endpoint=endpoint))
            r = httpx.post(url + "/v1/completions", headers={"traceparent": TRACEPARENT}, timeout=30,
                           json={"model": "fake", "prompt": "x"})
            assert r.status_code == 200
            service.tracing.provider.force_flush()
            service.tracing.shutdown()
            service.tracing = None
    finally:
        server.shutdown()
    spans = [s for path, req in got for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert {path for path, _ in got} == {"/v1/traces"}
    assert sorted(s.name for s in spans) == ["admission", "attempt", "text_completion fake"]
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}


def test_off_unless_an_endpoint_is_set_in_the_config_or_otels_variables(monkeypatch):
    from gateway.tracing import endpoint_of, make_tracing

    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert make_tracing(ObservabilityConfig()) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert endpoint_of(ObservabilityConfig()) == "http://collector:4318"
    assert endpoint_of(ObservabilityConfig(otlp_traces_endpoint="grpc://c:4317")) == "grpc://c:4317"
    tracing = make_tracing(ObservabilityConfig(sample_ratio=0.1))
    assert tracing is not None
    tracing.shutdown()
