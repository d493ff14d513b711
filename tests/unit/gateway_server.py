"""Run the real gateway app (uvicorn, real sockets) around fake engines, in a thread."""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager

import httpx
import uvicorn

from gateway.config import parse_config
from gateway.http.app import build_app
from gateway.serving.service import Service
from tests.waiting import wait_for
from workers.fake_engine import FakeDeployment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fake_gateway(engine_args: dict | None = None, replicas: int = 1, models: tuple[str, ...] = ("fake",),
                 extra: dict | None = None, deployment_factory=None, wait_ready: bool = True):
    port = free_port()
    config = parse_config({
        **{k: v for k, v in (extra or {}).items() if k not in ("model_fields", "gateway")},
        "gateway": {"port": port, "health_interval_s": 0.2, **(extra or {}).get("gateway", {})},
        "models": [{"name": m, "kind": "autoregressive", "source": "none", "replicas": replicas,
                    **(extra or {}).get("model_fields", {})} for m in models],
    })
    deployment = deployment_factory(config) if deployment_factory else FakeDeployment(engine_args or {})
    service = Service(config, deployment)
    server = uvicorn.Server(uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, "the fake gateway's server to start")
    if wait_ready:
        wait_for(service.router.ready, "the fake gateway's replicas to be ready")
    try:
        yield f"http://127.0.0.1:{port}", service, deployment
    finally:
        server.should_exit = True
        thread.join(3)
        if thread.is_alive():
            import faulthandler
            import sys
            faulthandler.dump_traceback(sys.stderr)
        thread.join(10)


def stream_outcome(url: str, num_tokens: int, model: str = "fake", timeout: float = 30,
                   first_token: threading.Event | None = None, served: dict | None = None) -> str:
    """One streamed chat request: 'ok' (the whole answer), 'error' (an error status, or an error
    event then [DONE]), else 'bad: ...' (silence, truncation, malformed). Bounded in time.
    ``first_token`` is set once the first content token has reached the client (the request is
    then past its first byte: a replica failure can no longer be retried, it must end the stream);
    ``served["replica"]`` is then the replica that serves it (the ``x-tandem-replica`` header)."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": True}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return "error"
            if served is not None:
                served["replica"] = r.headers.get("x-tandem-replica")
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    events.append(ln[6:])
                    if first_token is not None and "tok" in ln:
                        first_token.set()
    except httpx.HTTPError as e:
        return f"bad: {type(e).__name__}"
    if events and events[-1] == "[DONE]" and any("error" in json.loads(e) for e in events[:-1]):
        return "error"
    if events and events[-1] == "[DONE]" and sum("tok" in e for e in events) == num_tokens:
        return "ok"
    return f"bad: {events[-3:]}"


def complete_outcome(url: str, num_tokens: int, model: str = "fake", timeout: float = 30) -> str:
    """One non-streamed completion: 'ok' (the whole text), 'error' (an error status in the
    envelope), else 'bad: ...'."""
    try:
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "x"}, timeout=timeout)
    except httpx.HTTPError as e:
        return f"bad: {type(e).__name__}"
    if r.status_code == 200:
        text = r.json()["choices"][0]["text"]
        return "ok" if text.split() == [f"tok{i}" for i in range(num_tokens)] else f"bad: {text!r}"
    return "error" if set(r.json().get("error", {})) == {"message", "type", "param", "code"} else f"bad: {r.text}"


class HeldStreams:
    """Streams under way, the victim replica held: ``n`` streams started, each past its first
    token (each knows its replica from ``x-tandem-replica``), then ``hold()`` (the victim's engine
    emits and finishes nothing; health checks pass). ``held`` of its streams can no longer finish;
    its others finished before the hold (a slow box) and have reached their clients by the end of
    ``__init__``. Nothing here depends on timing."""

    def __init__(self, ex, url: str, victim_id: str, hold, running, n: int, num_tokens: int):
        first, served = [threading.Event() for _ in range(n)], [{} for _ in range(n)]
        self.futures = [ex.submit(stream_outcome, url, num_tokens, timeout=120, first_token=e, served=s)
                        for e, s in zip(first, served, strict=True)]
        wait_for(lambda: all(e.is_set() for e in first), "every stream to receive its first token")
        hold()
        self.held = running()
        self.on_victim = [i for i, s in enumerate(served) if s["replica"] == victim_id]
        done_first = len(self.on_victim) - self.held
        wait_for(lambda: sum(self.futures[i].done() for i in self.on_victim) == done_first,
                 "the victim's finished streams to reach their clients")

    def check(self) -> None:
        """Held streams end with an error event then [DONE]; every other stream completes."""
        results = [f.result(timeout=120) for f in self.futures]
        mine = sorted(results[i] for i in self.on_victim)
        assert mine == ["error"] * self.held + ["ok"] * (len(mine) - self.held), results
        assert all(r == "ok" for i, r in enumerate(results) if i not in self.on_victim), results
