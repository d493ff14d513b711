"""One access line per request (issue 35, `--access-log`), as text or JSON (`--log-format json`):
its id (the client's X-Request-Id, echoed, or a new one), status, model, tenant, queue time,
time to first byte, total time and the tokens of the usage the client received."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest

from gateway.observability import logs
from tests.unit.gateway_server import fake_gateway

KEY = "sk-access-0123456789abcdef"


@pytest.fixture()
def lines(monkeypatch):
    monkeypatch.setattr(logs, "_enabled", True)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter({"gateway_process": 0}))
    logs.ACCESS.addHandler(handler)
    logs.ACCESS.setLevel(logging.INFO)
    yield lambda: [json.loads(x) for x in out.getvalue().splitlines()]
    logs.ACCESS.removeHandler(handler)


def test_each_request_leaves_one_json_access_line(lines):
    extra = {"auth": {"api_keys": [{"key": KEY, "name": "team-key", "tenant": "team"}]}}
    with fake_gateway({"num_tokens": 4}, extra=extra) as (url, _, _):
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(url + "/v1/completions", headers={**auth, "X-Request-Id": "my-id-1"},
                       json={"model": "fake", "prompt": "x"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"
        usage = r.json()["usage"]
        with httpx.stream("POST", url + "/v1/chat/completions", headers=auth, timeout=30,
                          json={"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True}) as s:
            streamed_id = s.headers["x-request-id"]
            list(s.iter_lines())
        missing = httpx.post(url + "/v1/completions", headers=auth, json={"model": "nope", "prompt": "x"}, timeout=30)
        assert missing.status_code == 404
    got = [x for x in lines() if x["path"] != "/health"]
    assert [x["request_id"] for x in got] == ["my-id-1", streamed_id, missing.headers["x-request-id"]]
    first, stream, refused = got
    assert (first["status"], first["model"], first["tenant"], first["key"]) == (200, "fake", "team", "team-key")
    assert (first["prompt_tokens"], first["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert first["total_ms"] >= first["ttft_ms"] >= first["queue_ms"] >= 0 and first["replica"]
    assert first["level"] == "info" and first["logger"] == "tandem.access" and first["gateway_process"] == 0
    assert first["ts"].endswith("+00:00") and first["message"].startswith("POST /v1/completions 200")
    assert stream["status"] == 200 and stream["ttft_ms"] >= 0 and "prompt_tokens" not in stream  # no usage asked
    assert refused["status"] == 404 and refused["tenant"] == "team" and "ttft_ms" not in refused


def test_a_text_line_names_the_same_fields():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter(logs.TEXT_FORMAT))
    logs.ACCESS.addHandler(handler)
    logs.ACCESS.setLevel(logging.INFO)
    try:
        logs.log_access({"request_id": "r1", "tandem_model": "m", "tandem_stats": {"queue_s": 0.5, "ttft_s": 0.75,
                                                                                   "prompt_tokens": 3}},
                        "POST", "/v1/chat/completions", 200, 1.25)
    finally:
        logs.ACCESS.removeHandler(handler)
    line = out.getvalue()
    assert "POST /v1/chat/completions 200 request_id=r1 model=m total_ms=1250.0 queue_ms=500.0 ttft_ms=750.0" in line
    assert "prompt_tokens=3" in line


def test_a_traced_request_names_its_trace(lines):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.observability.tracing import Tracing
    from tandem_core.config import ObservabilityConfig

    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with fake_gateway({"num_tokens": 2}) as (url, service, _):
        service.tracing = Tracing(ObservabilityConfig(), InMemorySpanExporter(), batch=False)
        try:
            for flags in ("01", "00"):  # sampled, then not: only a trace that exists is named
                r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=30,
                               headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-{flags}"})
                assert r.status_code == 200
        finally:
            service.tracing = None
    sampled, unsampled = [x for x in lines() if x["path"] == "/v1/completions"]
    assert sampled["trace_id"] == trace_id and "trace_id" not in unsampled
