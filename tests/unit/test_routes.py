"""The routes besides chat and completions through the gateway, on fake engines in-process:
stored responses find the replica that created them, a route an engine lacks is a 400 naming
route and model, Anthropic routes answer errors in Anthropic's shape, streams of named events
end cleanly or with the route's error event."""

import json

import httpx
import openai
import pytest

from gateway.http.streaming import error_event
from gateway.serving.serve import replica_of_response, response_id
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import ROUTE_TABLE, ROUTES, served_routes
from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for
from workers.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def gw():
    with fake_gateway({"num_tokens": 4}, replicas=3) as g:
        yield g


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_an_engine_serves_the_routes_it_has_a_method_for():
    assert served_routes(FakeEngine("m")) == ("chat", "completions", "responses", "responses_retrieve",
                                              "responses_cancel", "tokenize", "detokenize")
    assert set(served_routes(FakeEngine("m"))) < set(ROUTES)


def test_responses_through_the_sdk_streamed_and_not(gw):
    url, _, _ = gw
    c = _client(url)
    r = c.responses.create(model="fake", input="hi", max_output_tokens=3)
    assert r.output_text == "tok0 tok1 tok2" and r.id.startswith("resp_")
    events = list(c.responses.create(model="fake", input="hi", stream=True))
    assert [e.type for e in events][0] == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "tok0 tok1 tok2 tok3"


def test_stored_responses_are_retrieved_from_the_replica_that_created_them(gw):
    url, service, deployment = gw
    c = _client(url)
    ids = [c.responses.create(model="fake", input="hi").id for _ in range(9)]
    holders = {rid: [name for name, e in deployment.engines.items() if rid in e.responses_store] for rid in ids}
    assert all(len(h) == 1 for h in holders.values())
    assert len({h[0] for h in holders.values()}) > 1  # spread over replicas, so routing matters
    for rid in ids:
        assert replica_of_response(service, rid).id == holders[rid][0]
        got = httpx.get(f"{url}/v1/responses/{rid}", timeout=10)
        assert got.status_code == 200 and got.json()["id"] == rid
        assert got.headers["x-tandem-replica"] == holders[rid][0]
        assert c.responses.retrieve(rid).output_text == "tok0 tok1 tok2 tok3"
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        c.responses.cancel(ids[0])


@pytest.mark.parametrize("rid", ["resp_nothex_1", "resp_", "resp_" + b"nobody/0".hex() + "_x", "other"])
def test_an_unknown_response_id_is_vllms_404(gw, rid):
    url, _, _ = gw
    for method, path in (("GET", f"/v1/responses/{rid}"), ("POST", f"/v1/responses/{rid}/cancel")):
        r = httpx.request(method, url + path, timeout=10)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == f"Response with id '{rid}' not found."
        assert r.json()["error"]["param"] == "response_id"


def test_response_ids_name_their_replica(gw):
    _, service, _ = gw
    for replica in service.router.all_replicas():
        assert replica_of_response(service, response_id(replica.id)) is replica
        assert replica_of_response(service, response_id(replica.id), "other-model") is None


def test_tokenize_round_trips_with_detokenize(gw):
    url, _, _ = gw
    tok = httpx.post(url + "/tokenize", json={"model": "fake", "prompt": "abc"}, timeout=10).json()
    assert tok["tokens"] == [97, 98, 99] and tok["count"] == 3
    back = httpx.post(url + "/detokenize", json={"model": "fake", "tokens": tok["tokens"]}, timeout=10)
    assert back.json() == {"prompt": "abc"}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_route_the_engine_lacks_is_a_400_naming_route_and_model_in_anthropics_shape(gw, path):
    url, _, _ = gw
    r = httpx.post(url + path, json={"model": "fake", "max_tokens": 3, "messages": [{"role": "user",
                                                                                      "content": "x"}]}, timeout=10)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(f"POST {path} is not served by model 'fake' (kind: autoregressive)")
    assert "POST /v1/responses" in body["error"]["message"]  # what it does serve


def test_anthropic_routes_answer_every_error_in_anthropics_shape(gw):
    url, _, _ = gw
    cases = [({"model": "nope", "max_tokens": 3, "messages": []}, 404, "not_found_error"),
             (b"{not json", 400, "invalid_request_error")]
    for body, status, kind in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(url + "/v1/messages", timeout=10, **kw)
        assert r.status_code == status
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
        assert int(r.headers["content-length"]) == len(r.content)
    other = httpx.post(url + "/v1/responses", json={"model": "nope", "input": "x"}, timeout=10)
    assert other.status_code == 404 and "error" in other.json() and "type" not in other.json()


def test_a_responses_stream_that_fails_midway_ends_with_its_error_event():
    with fake_gateway({"num_tokens": 4, "fail": "midstream"}) as (url, _, _):
        with httpx.stream("POST", url + "/v1/responses", json={"model": "fake", "input": "x", "stream": True},
                          timeout=10) as r:
            text = "".join(r.iter_text())
    assert r.status_code == 200 and "[DONE]" not in text
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    assert json.loads(last.split("data: ", 1)[1])["type"] == "error"


def test_error_events_take_the_routes_framing():
    err = TandemError(ErrorKind.ENGINE_ERROR, "boom")
    anthropic = json.loads(error_event("messages", err).split("data: ", 1)[1])
    assert anthropic == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    responses = json.loads(error_event("responses", err).split("data: ", 1)[1])
    assert responses["type"] == "error" and responses["message"] == "boom" and responses["code"] == "server_error"


def test_new_routes_are_counted_under_their_own_label(gw):
    url, service, _ = gw
    httpx.post(url + "/tokenize", json={"model": "fake", "prompt": "abc"}, timeout=10)
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'route="/tokenize"' in text


def test_the_app_serves_exactly_the_route_table_and_documents_it(gw):
    """One route table (``tandem_core.protocol.ROUTE_TABLE``): every route the app serves is in it
    (with its method and description), and every route in it is served."""
    url, service, _ = gw
    paths = httpx.get(url + "/openapi.json", timeout=10).json()["paths"]
    served = {(m.lower(), path) for path, ops in paths.items() for m in ops}
    table = {(r.method.lower(), r.path.replace(":path", "")) for r in ROUTE_TABLE}
    assert served == table
    for r in ROUTE_TABLE:
        op = paths[r.path.replace(":path", "")][r.method.lower()]
        assert op["description"] == r.doc, r.name
    assert paths["/v1/chat/completions"]["post"]["operationId"].startswith("chat_completions")
    for _, path in ROUTES.values():
        assert path in paths
    schema = paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["model", "input"]


def test_a_responses_stream_the_client_leaves_is_aborted_in_the_engine():
    with fake_gateway({"num_tokens": 1000, "token_delay_s": 0.01}) as (url, service, deployment):
        engine = next(iter(deployment.engines.values()))
        actor = service.router.all_replicas()[0].handle.actor
        with httpx.stream("POST", url + "/v1/responses", json={"model": "fake", "input": "x", "stream": True},
                          timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines) == "event: response.created"
            wait_for(lambda: engine.progress > 0, "tokens are generated")
        wait_for(lambda: not any(o.tasks for o in actor._channels.values()),
                 "the abandoned responses stream ends in the replica")
        assert engine.progress < 1000  # aborted, not finished


def test_the_request_timeout_holds_on_the_new_routes():
    with fake_gateway({"num_tokens": 1000, "token_delay_s": 0.05}, extra={"limits": {"request_timeout_s": 0.5}}
                      ) as (url, _, _):
        r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "x", "stream": True}, timeout=30)
    assert r.status_code == 200 and r.text.rstrip().split("\n\n")[-1].startswith("event: error")
    assert "request_timeout_s" in r.text


def test_token_estimates_of_the_new_routes():
    from gateway.request.limits import estimate_tokens

    assert estimate_tokens({"input": "a" * 40, "max_output_tokens": 10}) == 10 + 10
    assert estimate_tokens({"input": [{"role": "user", "content": "a" * 8}]}) == 2 + 256
    assert estimate_tokens({"prompt": "a" * 40}, generates=False) == 10  # tokenize: no output
    assert estimate_tokens({"tokens": [1, 2]}, generates=False) == 1


def test_openapi_diffusion_object_is_the_engines_knobs_schema(gw):
    """One schema source: the document's ``diffusion`` object (chat, completions, responses) is
    generated from ``DiffusionKnobs``, bounds included, so it cannot drift from what the engine
    validates."""
    from annotated_types import Ge, Gt, Le

    from diffusion_plugin.api.params import DiffusionKnobs, knobs_schema

    url, _, _ = gw
    paths = httpx.get(url + "/openapi.json", timeout=10).json()["paths"]
    knobs = knobs_schema()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["properties"]["diffusion"] == knobs, path
    props = knobs["properties"]
    for name, field in DiffusionKnobs.model_fields.items():
        doc = props[name]["anyOf"][0] if "anyOf" in props[name] else props[name]
        want = {}
        for m in field.metadata:
            if isinstance(m, Ge):
                want["minimum"] = m.ge
            elif isinstance(m, Gt):
                want["exclusiveMinimum"] = m.gt
            elif isinstance(m, Le):
                want["maximum"] = m.le
        got = {k: doc[k] for k in ("minimum", "exclusiveMinimum", "maximum") if k in doc}
        assert got == want, name
        assert props[name]["description"], name
    # The bounds the hand-written copy had wrong (issue 13).
    assert props["max_denoising_steps"]["anyOf"][0]["maximum"] == 1024
    assert props["t_min"]["anyOf"][0]["maximum"] == props["t_max"]["anyOf"][0]["maximum"] == 100
    assert props["stability_threshold"]["anyOf"][0]["minimum"] == 0
    assert "maximum" not in props["confidence_threshold"]["anyOf"][0]
