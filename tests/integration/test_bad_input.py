"""Bad input gets the right status and the OpenAI envelope; the server keeps serving."""

import httpx
import pytest

MODEL = "tiny-llama"
OK_MSG = [{"role": "user", "content": "hello"}]

CASES = [
    ("non-JSON body", b"{this is not json", 400, None),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("messages of the wrong type", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("negative max_tokens", {"model": MODEL, "messages": OK_MSG, "max_tokens": -5}, 400, "max_tokens"),
    ("unknown model", {"model": "no-such-model", "messages": OK_MSG}, 404, "model"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("prompt over the context", {"model": MODEL, "messages": [{"role": "user", "content": "river " * 700}]},
     400, "messages"),
]


@pytest.mark.parametrize("name, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_bad_chat_input(stack, name, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    if name == "prompt over the context":
        assert err["code"] == "context_length_exceeded" and "512" in err["message"]


def test_bad_completion_input(stack):
    r = httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "x " * 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_server_still_serves_after_bad_input(stack):
    for _, body, _, _ in CASES:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(stack.url + "/v1/chat/completions", timeout=60, **kw)
    r = stack.client().chat.completions.create(model=MODEL, messages=OK_MSG, max_tokens=4,
                                               extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
