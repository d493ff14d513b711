"""The gateway app against fake engines: routing, the error envelope, streaming, disconnects."""

import json
import socket

import httpx
import openai
import pytest

from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def gw():
    with fake_gateway({"num_tokens": 4}, replicas=2, models=("fake", "other")) as g:
        yield g


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_chat_and_completions_through_the_sdk(gw):
    url, _, _ = gw
    c = _client(url)
    r = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a b"}], max_tokens=3)
    assert r.choices[0].message.content == "tok0 tok1 tok2" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 2
    chunks = list(c.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}], stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "tok0 tok1 tok2 tok3 "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert c.completions.create(model="fake", prompt="p", max_tokens=2).choices[0].text == "tok0 tok1"


def test_models_list_and_get(gw):
    url, _, _ = gw
    c = _client(url)
    assert sorted(m.id for m in c.models.list()) == ["fake", "other"]
    assert c.models.retrieve("fake").owned_by == "tandem"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("missing")


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"messages": []}', 400, "model"),
    (b'{"model": "missing", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (b'{"model": "fake", "messages": []}', 400, "messages"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400, "max_tokens"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": "' + b"w " * 100 + b'"}]}', 400, "messages"),
])
def test_bad_input_gets_the_envelope(gw, body, status, param):
    url, _, _ = gw
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_unknown_route_and_method_are_enveloped(gw):
    url, _, _ = gw
    r = httpx.get(url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_health_and_ready(gw):
    url, _, _ = gw
    assert httpx.get(url + "/health").json()["status"] == "ok"
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 200 and ready.json()["models"]["fake"]["ready"]


def test_requests_spread_over_replicas():
    with fake_gateway({"num_tokens": 2, "token_delay_s": 0.2}, replicas=2) as (url, service, dep):
        import concurrent.futures as cf

        def one(_):
            return httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p"}, timeout=10).status_code

        for e in dep.engines.values():
            e.stall = True  # held: all four are in flight together, however slowly they are sent
        with cf.ThreadPoolExecutor(4) as ex:
            futures = [ex.submit(one, i) for i in range(4)]
            wait_for(lambda: sum(len(e.running) for e in dep.engines.values()) == 4, "all four in the engines")
            served = {rid: len(e.served) for rid, e in dep.engines.items()}
            for e in dep.engines.values():
                e.stall = False
            assert [f.result() for f in futures] == [200] * 4
        assert sorted(served.values()) == [2, 2], served  # least outstanding spreads them evenly
        assert all(r.outstanding == 0 for r in service.router.all_replicas())


def test_streaming_disconnect_aborts_the_engine_request():
    with fake_gateway({"num_tokens": 1000, "token_delay_s": 0.01}) as (url, service, dep):
        engine = next(iter(dep.engines.values()))
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json={"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            assert engine.running
        # aborted (cancelled in the engine), not finished: 1000 tokens would take 10 s
        wait_for(lambda: not engine.running and len(engine.aborted) == 1, "the engine to abort the request")
        wait_for(lambda: service.router.all_replicas()[0].outstanding == 0, "the gateway to release the slot")


def test_non_streaming_disconnect_aborts_the_engine_request():
    with fake_gateway({"num_tokens": 1000, "token_delay_s": 0.01}) as (url, service, dep):
        engine = next(iter(dep.engines.values()))
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=0.5)
        wait_for(lambda: not engine.running and len(engine.aborted) == 1, "the engine to abort the request")
        wait_for(lambda: service.router.all_replicas()[0].outstanding == 0, "the gateway to release the slot")


def test_midstream_failure_ends_with_error_event_then_done():
    with fake_gateway({"num_tokens": 5, "fail": "midstream"}) as (url, _, _):
        r = httpx.post(url + "/v1/chat/completions",
                       json={"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]) and "tok0" in events[0]


def test_engine_failure_before_output_is_500_and_server_keeps_serving():
    with fake_gateway({"fail": "request"}) as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "Traceback" not in r.text
        assert httpx.get(url + "/health").status_code == 200


def test_metrics_can_live_on_their_own_port():
    from tests.unit.gateway_server import free_port

    mport = free_port()
    with fake_gateway({"num_tokens": 2}, extra={"metrics": {"port": mport}}) as (url, _, _):
        httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p"})
        assert httpx.get(url + "/metrics").status_code == 404  # not on the API port
        text = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
        assert 'tandem_requests_total{model="fake",route="/v1/completions",status="2xx"} 1.0' in text


def test_metrics_count_requests_and_rejections_on_the_api_port(gw):
    url, _, _ = gw
    def value(name, **labels):
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    ok0 = value("tandem_requests_total", model="fake", route="/v1/chat/completions", status="2xx")
    bad0 = value("tandem_requests_rejected_total", model="other", reason="unknown_model")
    for _ in range(3):
        httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})
    httpx.post(url + "/v1/chat/completions", json={"model": "zzz", "messages": []})
    assert value("tandem_requests_total", model="fake", route="/v1/chat/completions", status="2xx") == ok0 + 3
    assert value("tandem_requests_rejected_total", model="other", reason="unknown_model") == bad0 + 1


def test_overload_burst_gets_429_with_retry_after_and_accepted_requests_complete():
    import concurrent.futures as cf

    extra = {"gateway": {"max_queue": 3}, "model_fields": {"max_in_flight_per_replica": 1}}
    with fake_gateway({"num_tokens": 3, "token_delay_s": 0.05}, extra=extra) as (url, service, dep):
        engine = next(iter(dep.engines.values()))
        engine.stall = True  # held: the burst meets a full replica and a full queue, however slowly it is sent

        def one(_):
            return httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p"}, timeout=60,
                              headers={"x-tandem-queue-deadline-ms": "60000"})

        with cf.ThreadPoolExecutor(16) as ex:
            futures = [ex.submit(one, i) for i in range(16)]  # 4x capacity (1 running + 3 queued)
            wait_for(lambda: sum(f.done() for f in futures) == 12 and service.router.pools["fake"].queued == 3,
                     "12 refusals while 1 request runs and 3 wait")
            refused = [f.result() for f in futures if f.done()]
            engine.stall = False
            results = [f.result(timeout=60) for f in futures]
        assert [r.status_code for r in refused] == [429] * 12
        assert all(r.headers["Retry-After"].isdigit() for r in refused)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in refused)
        accepted = [r for r in results if r not in refused]
        assert [r.status_code for r in accepted] == [200] * 4
        assert all(r.json()["choices"][0]["text"] == "tok0 tok1 tok2" for r in accepted)
        # the gateway's own measure of queue waits saw each accepted request once
        buckets = {b.labels["le"]: b.value for m in service.metrics.registry.collect()
                   if m.name == "tandem_queue_wait_seconds" for b in m.samples
                   if b.name.endswith("_bucket") and b.labels["model"] == "fake"}
        assert buckets["+Inf"] == 4, buckets
        wait_for(lambda: service.in_flight() == 0 and service.router.pools["fake"].queued == 0, "nothing left in flight")


def test_session_affinity_keeps_a_user_on_one_replica():
    extra = {"model_fields": {"session_affinity": {"enabled": True}}}
    with fake_gateway({"num_tokens": 2}, replicas=3, extra=extra) as (url, _, dep):
        def served_by(**kw) -> str:
            before = {rid: len(e.served) for rid, e in dep.engines.items()}
            r = httpx.post(url + "/v1/chat/completions", timeout=10, **kw)
            assert r.status_code == 200
            return next(rid for rid, e in dep.engines.items() if len(e.served) > before[rid])

        msg = [{"role": "user", "content": "x"}]
        for user in ("alice", "bob", "carol"):
            assert len({served_by(json={"model": "fake", "messages": msg, "user": user}) for _ in range(5)}) == 1
        by_header = {served_by(json={"model": "fake", "messages": msg}, headers={"x-session-id": "s1"})
                     for _ in range(5)}
        assert len(by_header) == 1
        homes = {served_by(json={"model": "fake", "messages": msg, "user": f"u{i}"}) for i in range(12)}
        assert len(homes) >= 2  # different sessions spread


def test_queue_deadline_header_sheds_with_408():
    extra = {"gateway": {"max_queue": 4}, "model_fields": {"max_in_flight_per_replica": 1}}
    with fake_gateway({"num_tokens": 10, "token_delay_s": 0.1}, extra=extra) as (url, service, dep):
        import threading

        engine = next(iter(dep.engines.values()))
        engine.stall = True  # held: the slot stays taken while the second request waits
        t = threading.Thread(target=lambda: httpx.post(url + "/v1/completions",
                                                       json={"model": "fake", "prompt": "p"}, timeout=30))
        t.start()
        wait_for(lambda: service.router.all_replicas()[0].outstanding == 1, "the first request to take the slot")
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p"},
                       headers={"x-tandem-queue-deadline-ms": "100"}, timeout=30)
        assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error"
        bad = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p"},
                         headers={"x-tandem-queue-deadline-ms": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-tandem-queue-deadline-ms"
        engine.stall = False
        t.join(60)
        assert not t.is_alive()


def test_a_finished_request_sends_no_abort_to_its_replica():
    """The gateway stops reading at the last item ([DONE], a whole body, an error): that must not
    cost an abort round trip to the replica per request. A client that leaves early still aborts:
    its abort, sent after the finished ones', is the moment to check that none came before it."""
    with fake_gateway({"num_tokens": 3}) as (url, service, dep):
        handle = service.router.all_replicas()[0].handle
        calls: list[tuple] = []
        real_call = handle.call

        async def spy(method, *args):
            calls.append((method, *args))
            return await real_call(method, *args)

        handle.call = spy
        chat = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(url + "/v1/chat/completions", json=chat).status_code == 200
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert "data: [DONE]" in list(r.iter_lines())
        assert httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": -1}).status_code == 400
        before = sum(m == "submit" for m, *_ in calls)
        dep.engines[next(iter(dep.engines))].stall = True  # the sentinel: held until its client leaves
        body = json.dumps({**chat, "stream": True}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:  # a client we can make leave at will
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: sum(m == "submit" for m, *_ in calls) == before + 1, "the held request reaches the replica")
        wait_for(lambda: any(m == "abort" for m, *_ in calls), "the gone client's request to be aborted")
        submitted = [a[-1].request_id for m, *a in calls if m == "submit"]  # an EngineRequest
        assert [a[-1] for m, *a in calls if m == "abort"] == [submitted[-1]], calls


def test_prefix_routing_through_the_gateway_sends_each_tenant_back_to_its_replica():
    """`routing: prefix` end to end (fake engines, 2 replicas): each tenant's requests, which share
    a long system prompt, land where its first one went (the `x-tandem-replica` header says
    where), and the tenants do not all pile onto one replica."""
    with fake_gateway({"num_tokens": 2}, replicas=2, extra={"model_fields": {"routing": "prefix"}}) as (url, _, _):
        def replica(tenant: int, question: str) -> str:
            system = f"tenant {tenant}: " + "-".join(f"rule{tenant}.{i}" for i in range(120))  # ~1 kB: 4 blocks, one word
            r = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": question}]})
            assert r.status_code == 200, r.text
            return r.headers["x-tandem-replica"]

        first = {t: replica(t, "hello?") for t in range(8)}
        again = {t: replica(t, f"question {q} for {t}") for q in range(3) for t in range(8)}
        assert again == first
        assert len(set(first.values())) == 2, first


def test_reset_prefix_cache_reaches_every_live_replica_of_the_model_or_of_all(gw):
    """vLLM's POST /reset_prefix_cache (its dev mode's route): {"success": ...}; ``model`` narrows
    it to one model's replicas; an unknown model is a 404 in the envelope."""
    url, service, dep = gw
    before = {rid: getattr(e, "prefix_resets", 0) for rid, e in dep.engines.items()}
    r = httpx.post(url + "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True, "replicas": 4}
    assert all(getattr(e, "prefix_resets", 0) == before[rid] + 1 for rid, e in dep.engines.items())
    r = httpx.post(url + "/reset_prefix_cache", params={"model": "other"})
    assert r.json() == {"success": True, "replicas": 2}
    fake = {r.id for r in service.router.pool("fake").replicas}
    assert all(getattr(e, "prefix_resets", 0) == before[rid] + (1 if rid in fake else 2)
               for rid, e in dep.engines.items())
    r = httpx.post(url + "/reset_prefix_cache", params={"model": "missing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_the_metrics_port_keeps_vllms_names_for_prometheus_2s_accept_header():
    """prometheus_client 0.26's OpenMetrics writer turns ``vllm:x`` samples into ``vllm_x``; the
    metrics port answers Prometheus's text format whatever the scraper asks (as the API port)."""
    from prometheus_client import CollectorRegistry

    from diffusion_plugin.batcher.vllm_names import vllm_exposition
    from gateway.observability.metrics import engine_families
    from gateway.observability.metrics_server import serve_metrics
    from tests.unit.gateway_server import free_port

    class Engines:
        def collect(self):
            return engine_families([("m", "m/0", "serving", {"exposition": vllm_exposition("m", 1, 0, 5, 6, {}, 0.5)})])

    registry = CollectorRegistry()
    registry.register(Engines())
    port = free_port()
    server = serve_metrics(port, "127.0.0.1", registry)
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": (
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
            "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")})
    finally:
        server.shutdown()
        server.server_close()
    assert r.headers["content-type"].startswith("text/plain")
    assert 'vllm:num_requests_running{engine="0",model_name="m",replica="m/0"} 1.0' in r.text
    assert "vllm_" not in r.text
