"""vLLM's `priority` on both model kinds (issue 33): the real engines take it (vLLM with its
priority scheduling policy, the diffusion scheduler's order), a bad value is a 400 naming it."""

import httpx
import pytest

MODELS = ("tiny-llama", "tiny-diffusiongemma")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
])
def test_priority_is_taken_on_both_kinds(stack, model, route, body):
    for priority in (-3, 0, 7):
        r = httpx.post(stack.url + route, json={"model": model, "max_tokens": 4, "priority": priority, **body},
                       timeout=120)
        assert r.status_code == 200, r.text
    bad = httpx.post(stack.url + route, json={"model": model, "max_tokens": 4, "priority": "high", **body},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text


def test_priority_on_the_responses_route_of_the_diffusion_model(stack):
    r = httpx.post(stack.url + "/v1/responses", json={"model": "tiny-diffusiongemma", "input": "Hi",
                                                      "max_output_tokens": 4, "priority": 2}, timeout=120)
    assert r.status_code == 200, r.text
