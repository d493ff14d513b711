"""Readiness per model (issue 32): one model losing its only replica (SIGKILL) leaves the gateway
ready (/ready 200: the pod stays in its Service) and the other model serving; the lost model's
own requests get 503 with Retry-After (or an answer once it is back), never a hang; its own
readiness (/ready?model=) says it is down until its replica is back."""

import os
import signal

import httpx

from tests.waiting import wait_for

AR, DIFFUSION = "tiny-llama", "tiny-diffusiongemma"
CLIENT_TIMEOUT_S = 60  # a hang would run into this and fail the test


def _replica(url: str, model: str) -> dict:
    rows = httpx.get(url + "/admin/replicas", timeout=30).json()["replicas"]
    return next(r for r in rows if r["model"] == model)


def _ready(url: str, model: str | None = None) -> int:
    return httpx.get(url + "/ready", params={"model": model} if model else None, timeout=10).status_code


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2},
                      timeout=CLIENT_TIMEOUT_S)


def test_ready_names_models_and_unknown_ones_are_404(stack):
    r = httpx.get(stack.url + "/ready", params=[("model", AR), ("model", DIFFUSION)], timeout=10)
    assert r.status_code == 200 and r.json()["ready"] and r.json()["all_ready"]
    r = httpx.get(stack.url + "/ready", params={"model": "nope"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_model_without_replica_leaves_the_gateway_ready_and_the_other_model_serving(stack):
    url = stack.url
    wait_for(lambda: _ready(url, DIFFUSION) == 200, "the diffusion model to be ready")
    victim = _replica(url, DIFFUSION)
    os.kill(victim["pid"], signal.SIGKILL)
    # Down: a new process must start and load the model, so this holds for seconds.
    wait_for(lambda: _ready(url, DIFFUSION) == 503, "the killed model's own readiness to turn 503")
    down = httpx.get(url + "/ready", timeout=10)
    assert down.status_code == 200 and not down.json()["all_ready"], down.text
    assert not down.json()["models"][DIFFUSION]["ready"] and down.json()["models"][AR]["ready"]

    outcomes = []

    def check_once() -> bool:
        """One round while the model comes back: the gateway ready, the other model answering,
        the lost one answering 503 + Retry-After (or, once back, 200). True once it is back."""
        assert _ready(url) == 200 and _ready(url, AR) == 200
        r = _complete(url, AR)
        assert r.status_code == 200, r.text
        lost = _complete(url, DIFFUSION)
        outcomes.append(lost.status_code)
        if lost.status_code == 503:
            assert lost.headers.get("retry-after") and lost.json()["error"]["type"] == "service_unavailable_error"
        else:
            assert lost.status_code == 200, lost.text
        return _replica(url, DIFFUSION)["restarts"] >= victim["restarts"] + 1 and _ready(url, DIFFUSION) == 200

    wait_for(check_once, "the killed model to be back", timeout=300, interval=0.5)
    assert _complete(url, DIFFUSION).status_code == 200
    print(f"lost model's answers while it came back: {outcomes}")
