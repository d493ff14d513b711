"""Traces of requests (issue 35, ``gateway/observability/tracing.py``) on fake engines, into an in-memory
exporter: the request's span continues the client's `traceparent`, has the GenAI attributes and
the usage the client received; admission and attempt spans are its children; the attempt's
context crosses the hop in the request record; a failure is marked; off by default."""

from __future__ import annotations

import json

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.observability.tracing import Tracing
from tandem_core import tracing as replica_tracing
from tandem_core.config import ObservabilityConfig
from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


@pytest.fixture()
def traced():
    exporter = InMemorySpanExporter()
    with fake_gateway({"num_tokens": 3}) as (url, service, deployment):
        assert service.tracing is None  # off by default
        service.tracing = Tracing(ObservabilityConfig(), exporter, batch=False)
        replica_tracing.configure(None, exporter=exporter)  # the in-process replicas' (EngineActor's)
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
        replica_tracing.configure(None)


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
    # ... and continues it: the replica's span of the request is the attempt's child.
    replica = spans["replica chat"]
    assert replica.parent.span_id == attempt.context.span_id and replica.context.trace_id == request.context.trace_id
    assert replica.attributes["tandem.replica.id"] == "fake/0" and replica.attributes["tandem.replica.node"]


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
    assert tuple(stream.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    first = json.loads(next(x for x in lines if x.startswith("data: {"))[6:])
    assert stream.attributes["gen_ai.response.id"] == first["id"]
    exporter.clear()
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": -1}, timeout=30)
    assert r.status_code == 400
    (failed,) = [s for s in exporter.get_finished_spans() if s.name == "text_completion fake"]
    assert failed.status.status_code.name == "ERROR" and failed.attributes["error.type"] == "invalid_request"


def test_spans_reach_an_otlp_http_receiver():
    """The real exporter (OTLP over HTTP/protobuf, batched) to a receiver decoding what it gets."""
    from gateway.observability.tracing import make_tracing
    from tests.otlp_receiver import Receiver

    with Receiver() as receiver, fake_gateway({"num_tokens": 2}) as (url, service, _):
        service.tracing = make_tracing(ObservabilityConfig(otlp_traces_endpoint=receiver.endpoint))
        r = httpx.post(url + "/v1/completions", headers={"traceparent": TRACEPARENT}, timeout=30,
                       json={"model": "fake", "prompt": "x"})
        assert r.status_code == 200
        service.tracing.provider.force_flush()
        service.tracing.shutdown()
        service.tracing = None
    assert set(receiver.paths) == {"/v1/traces"}
    assert sorted(s.name for s in receiver.spans) == ["admission", "attempt", "text_completion fake"]
    assert {s.trace_id for s in receiver.spans} == {TRACE_ID}


def test_off_unless_an_endpoint_is_set_in_the_config_or_otels_variables(monkeypatch):
    from gateway.observability.tracing import endpoint_of, make_tracing

    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert make_tracing(ObservabilityConfig()) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert endpoint_of(ObservabilityConfig()) == "http://collector:4318"
    assert endpoint_of(ObservabilityConfig(otlp_traces_endpoint="grpc://c:4317")) == "grpc://c:4317"
    tracing = make_tracing(ObservabilityConfig(sample_ratio=0.1))
    assert tracing is not None
    tracing.shutdown()


def test_replicas_are_told_where_spans_go_and_vllm_gets_the_same_collector(monkeypatch):
    from tandem_core.tracing import replica_settings, vllm_exporter

    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert replica_settings(ObservabilityConfig()) is None  # off: the replicas build no tracer either
    assert replica_settings(ObservabilityConfig(otlp_traces_endpoint="http://c:4318", sample_ratio=0.5)) == {
        "endpoint": "http://c:4318", "sample_ratio": 0.5}
    # vLLM's exporter takes its URL as given and its protocol from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    assert vllm_exporter("http://c:4318") == ("http://c:4318/v1/traces", "http/protobuf")
    assert vllm_exporter("http://c:4318/v1/traces") == ("http://c:4318/v1/traces", "http/protobuf")
    assert vllm_exporter("grpc://c:4317") == ("http://c:4317", "grpc")


def test_tracing_off_runs_no_exporter_thread():
    import threading

    with fake_gateway({"num_tokens": 2}) as (url, service, _):
        assert service.tracing is None and replica_tracing.tracer() is None
        assert httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=30).status_code == 200
        assert not [t for t in threading.enumerate() if "Otel" in t.name or "Span" in t.name]


def test_a_request_retried_after_its_replica_died_has_two_attempts_in_one_trace():
    """The victim's engine holds its requests (stalled), then its replica dies: each request it
    held is retried on the other one, and its trace has two attempt spans, the first marked with
    the failure, the second on the survivor (whichever replica each request first landed on)."""
    import concurrent.futures as cf

    from tests.unit.test_failover import TOKENS, _gateway, _kill, _wait_for

    exporter = InMemorySpanExporter()
    with _gateway() as (url, service, deployment):
        service.tracing = Tracing(ObservabilityConfig(), exporter, batch=False)
        victim = service.router.pools["fake"].replicas[0]
        engine = deployment.engines[victim.id]
        engine.stall = True

        def complete(i: int) -> int:
            tp = f"00-{i:032x}-{PARENT}-01"
            return httpx.post(url + "/v1/completions", headers={"traceparent": tp}, timeout=60,
                              json={"model": "fake", "prompt": f"x{i}", "max_tokens": TOKENS}).status_code

        with cf.ThreadPoolExecutor(6) as ex:
            futures = [ex.submit(complete, i) for i in range(1, 7)]
            _wait_for(lambda: sum(f.done() for f in futures) + len(engine.running) == 6, 30,
                      "each request answered by the survivor or held by the victim")
            held = len(engine.running)
            _kill(service, victim)
            assert [f.result(timeout=60) for f in futures] == [200] * 6
        service.tracing = None
    assert held >= 1  # (the router spreads 6 requests over both replicas)
    attempts: dict[int, list] = {}
    for s in exporter.get_finished_spans():
        if s.name == "attempt":
            attempts.setdefault(s.context.trace_id, []).append(s)
    assert sorted(attempts) == list(range(1, 7))  # one trace per request, the client's
    retried = {t: a for t, a in attempts.items() if len(a) == 2}
    assert len(retried) == held and all(len(a) <= 2 for a in attempts.values())
    for first, second in (sorted(a, key=lambda s: s.start_time) for a in retried.values()):
        assert first.attributes["tandem.replica.id"] == victim.id != second.attributes["tandem.replica.id"]
        assert first.status.status_code.name == "ERROR" and first.attributes["error.type"] == "engine_dead"
        assert second.status.status_code.name == "UNSET" and first.parent.span_id == second.parent.span_id


def test_a_request_not_sampled_is_served_and_leaves_no_span(traced):
    """Sample ratio 0 (and an unsampled ``traceparent``): nothing recorded, on the gateway or the
    replica, and every answer as without tracing."""
    url, exporter, sent = traced
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
    unsampled = {"traceparent": f"00-{TRACE_ID}-{PARENT}-00"}
    assert httpx.post(url + "/v1/chat/completions", json=body, headers=unsampled, timeout=30).status_code == 200
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=unsampled,
                      timeout=30) as s:
        assert "data: [DONE]" in list(s.iter_lines())
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": -1}, headers=unsampled,
                   timeout=30)
    assert r.status_code == 400
    assert exporter.get_finished_spans() == ()
    assert all(req.trace["traceparent"].endswith("-00") for req in sent)  # the replica is told: not sampled
    # and a sample ratio of 0: no trace from a request that brings none
    with fake_gateway({"num_tokens": 2}) as (url, service, _):
        service.tracing = Tracing(ObservabilityConfig(sample_ratio=0), exporter, batch=False)
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        service.tracing = None
    assert exporter.get_finished_spans() == ()


def test_capture_content_records_a_streams_output_too():
    """observability.capture_content (issue 50: a stream's output was not recorded): a streamed
    chat's joined text per choice is its span's gen_ai.output.messages, as a whole answer's is."""
    from gateway.observability.tracing import note_stream_text as _note_text

    texts: dict[int, str] = {}
    _note_text(texts, 'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
    _note_text(texts, 'data: {"choices": [{"index": 1, "text": "b"}, {"index": 0, "delta": {}}]}\n\ndata: [DONE]\n\n')
    assert texts == {0: "a", 1: "b"}
    exporter = InMemorySpanExporter()
    with fake_gateway({"num_tokens": 3}) as (url, service, _):
        service.tracing = Tracing(ObservabilityConfig(capture_content=True), exporter, batch=False)
        try:
            body = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as s:
                streamed = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
                                   for x in s.iter_lines() if x.startswith("data: {"))
            wait_for(lambda: "chat fake" in _by_name(exporter), "the stream's span to end")
        finally:
            service.tracing = None
    span = _by_name(exporter)["chat fake"]
    assert "hello" in span.attributes["gen_ai.input.messages"]
    assert streamed and json.loads(span.attributes["gen_ai.output.messages"]) == [{"index": 0, "text": streamed}]
