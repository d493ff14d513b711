"""Roles, model lists and usage per tenant and key (issue 33, item 4 and 3): a user key gets 403
on every admin route and a 404 on a model outside its `models` (as if it did not exist); an admin
key gets through; the tenant and key counters equal the `usage` the clients received."""

import httpx
import openai
import pytest

from gateway.config import ConfigError, parse_config
from tandem_core.protocol import ROUTE_TABLE
from tests.unit.gateway_server import fake_gateway

ADMIN, USER, NARROW = "sk-admin-0123456789", "sk-user-0123456789", "sk-narrow-0123456789"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw():
    extra = {"auth": {"api_keys": [{"key": ADMIN, "name": "ops", "role": "admin"},
                                   {"key": USER, "name": "alice", "tenant": "team-a"},
                                   {"key": NARROW, "name": "bob", "tenant": "team-a", "models": ["fake"]}]}}
    with fake_gateway({"num_tokens": 3}, extra=extra, models=("fake", "other")) as g:
        yield g


def _h(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


ADMIN_ROUTES = [(r.method, r.path) for r in ROUTE_TABLE if r.admin]


def test_the_admin_routes_are_the_operators():
    assert {p for _, p in ADMIN_ROUTES} == {"/admin/replicas", "/admin/usage", "/reset_prefix_cache",
                                             "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}


@pytest.mark.parametrize("method,path", ADMIN_ROUTES)
def test_a_user_key_gets_403_on_every_admin_route_and_an_admin_key_gets_through(gw, method, path):
    url, _, _ = gw
    for key in (USER, NARROW):
        r = httpx.request(method, url + path, headers=_h(key), json={})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["type"] == "permission_error" and "admin key" in r.json()["error"]["message"]
    r = httpx.request(method, url + path, headers=_h(ADMIN), json={})
    assert r.status_code != 403 and r.status_code < 500, r.text  # through (a LoRA route may say 400 to {})
    assert httpx.get(url + "/admin/nothing-here", headers=_h(USER)).status_code == 403


def test_a_model_outside_a_keys_list_does_not_exist_for_it(gw):
    url, _, _ = gw
    narrow = _client(url, NARROW)
    assert [m.id for m in narrow.models.list()] == ["fake"]
    assert narrow.chat.completions.create(model="fake", messages=MSG).choices[0].message.content
    with pytest.raises(openai.NotFoundError) as e:
        narrow.chat.completions.create(model="other", messages=MSG)
    assert e.value.body["param"] == "model" and "other" not in e.value.body["message"].split("Valid")[1]
    with pytest.raises(openai.NotFoundError):
        narrow.models.retrieve("other")
    assert {m.id for m in _client(url, USER).models.list()} == {"fake", "other"}
    assert _client(url, USER).chat.completions.create(model="other", messages=MSG).choices[0].message.content


def test_usage_per_tenant_and_key_equals_what_the_clients_received(gw):
    url, _, _ = gw
    before = httpx.get(url + "/admin/usage", headers=_h(ADMIN)).json()
    got = {"prompt": 0, "completion": 0}
    for key, model in ((USER, "fake"), (USER, "other"), (NARROW, "fake")):
        r = _client(url, key).chat.completions.create(model=model, messages=MSG)
        got["prompt"] += r.usage.prompt_tokens
        got["completion"] += r.usage.completion_tokens
        for c in _client(url, key).chat.completions.create(model=model, messages=MSG, stream=True,
                                                           stream_options={"include_usage": True}):
            if c.usage is not None:
                got["prompt"] += c.usage.prompt_tokens
                got["completion"] += c.usage.completion_tokens
    after = httpx.get(url + "/admin/usage", headers=_h(ADMIN)).json()

    def total(doc: dict, who: str, what: str) -> int:
        return sum(row[what] for row in doc.get(who, {}).get("team-a", {}).values()) if who == "tenants" else \
            sum(row[what] for name in ("alice", "bob") for row in doc.get(who, {}).get(name, {}).values())

    for who in ("tenants", "keys"):
        assert total(after, who, "prompt_tokens") - total(before, who, "prompt_tokens") == got["prompt"]
        assert total(after, who, "generation_tokens") - total(before, who, "generation_tokens") == got["completion"]
        assert total(after, who, "requests") - total(before, who, "requests") == 6
    metrics = httpx.get(url + "/metrics", headers=_h(USER)).text
    assert 'tandem_tenant_requests_total{model="other",tenant="team-a"}' in metrics


def test_a_keys_models_must_exist_in_the_config():
    with pytest.raises(ConfigError) as e:
        parse_config({"auth": {"api_keys": [{"key": "k" * 12, "models": ["nope"]}]},
                      "models": [{"name": "m", "kind": "autoregressive", "source": "x"}]})
    assert "auth.api_keys.0.models: not a model, alias or adapter of this config: nope" in str(e.value)
    assert "\n" not in str(e.value)
