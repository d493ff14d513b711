"""SIGTERM to `tandem serve` in the middle of its work loses nothing (issue 50): what `docker stop`,
a pod's deletion and a rolling update send. Two gateway processes (``gateway.processes: 2``) serve
both tiny models; an 80-line chat batch (64 tokens a line, 16 in flight) runs and 16 streams are in flight (8 autoregressive, 8
diffusion) when the parent gets SIGTERM:

- ``/ready`` turns 503 (the Service drops the pod) and a new request gets 503 with Retry-After;
- every stream finishes with ``stop`` or ``length``, none cut;
- the process exits 0 by itself, within ``gateway.drain_timeout_s`` and a margin;
- the batch is not finalized with lines missing: still in progress, none failed;
- started again on the same data dir, the batch completes with every ``custom_id`` exactly once, no
  error line, and only the lines left pending are served again.

Its own stack: it is the stack's stop that is under test."""

from __future__ import annotations

import re
import signal
import sqlite3
import threading
import time

import httpx
import openai
import pytest

from tests.batches import answered, chat_lines, completed, submit
from tests.integration.stack import ENGINE_ARGS, READY_TIMEOUT_S, REPO, launch_config, running_stack, stop
from tests.unit.gateway_server import free_port
from tests.waiting import wait_for

LINES = 80  # 16 in flight: at the signal 16 or more answered, 16 in flight, the rest pending
LINE_TOKENS = 64
STREAMS = {"tiny-llama": 8, "tiny-diffusiongemma": 8}
DRAIN_S = 90

# alone under -n (tests/parallel.py): a drain measured against its grace period
pytestmark = [pytest.mark.alone, pytest.mark.timeout(int(2 * READY_TIMEOUT_S + 1800))]


def _config(tmp_path) -> dict:
    return {
        "gateway": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 2, "processes": 2,
                    "drain_timeout_s": DRAIN_S},
        "ray": {"num_cpus": 2},
        "models_dir": str(REPO / "models"),
        "batches": {"data_dir": str(tmp_path / "data"), "lease_s": 3, "poll_s": 0.5},
        "models": [{"name": "tiny-llama", "kind": "autoregressive", "source": "builtin:tiny-llama",
                    "resources": {"num_gpus": 0, "num_cpus": 1}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                    "engine_args": ENGINE_ARGS},
                   {"name": "tiny-diffusiongemma", "kind": "diffusion", "source": "builtin:tiny-diffusiongemma",
                    "resources": {"num_gpus": 0, "num_cpus": 1}, "engine_args": {"family": "diffusiongemma"}}],
    }


def _served_lines(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(r'^tandem_batch_lines_total\{outcome="completed"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


class Stream(threading.Thread):
    """One streamed chat request, long enough to outlast the signal: its text, finish reason or error."""

    def __init__(self, url: str, model: str, i: int):
        super().__init__(daemon=True)
        self.url, self.model, self.i = url, model, i
        self.started = threading.Event()
        self.text, self.finish, self.error = "", None, None

    def run(self) -> None:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)
        max_tokens = 300 if self.model == "tiny-llama" else 192  # long enough to outlast the batch's first 16 lines
        try:
            for chunk in client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": f"Tell me a long story, {self.i}."}],
                    max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}):
                for ch in chunk.choices:
                    self.text += ch.delta.content or ""
                    self.finish = ch.finish_reason or self.finish
                if self.text:
                    self.started.set()
        except Exception as e:  # noqa: BLE001 - what the test reports
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()


def _started(url: str, model: str) -> list[Stream]:
    """``model``'s streams, each once its first text came."""
    streams = [Stream(url, model, i) for i in range(STREAMS[model])]
    for s in streams:
        s.start()
    wait_for(lambda: all(s.started.is_set() for s in streams), f"every {model} stream's first text", timeout=300)
    assert not any(s.error for s in streams), [s.error for s in streams if s.error]
    return streams


def test_sigterm_mid_batch_and_mid_stream_loses_nothing(tmp_path):
    config = _config(tmp_path)
    proc, first = launch_config(config, tmp_path, "first.log")
    url, log = first.url, first.log
    streams: list[Stream] = []
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        # The diffusion streams first (their first text waits for a first block), then the batch's
        # first 16 answers, then the autoregressive streams (their first text within a second): the
        # signal follows at once, lines pending and streams of both kinds in flight, at any pace.
        streams = _started(url, "tiny-diffusiongemma")
        lines = chat_lines(LINES, "tiny-llama", max_tokens=LINE_TOKENS, temperature=0, ignore_eos=True)
        batch_id = submit(client, lines)
        answered(client, batch_id, 16)
        streams += _started(url, "tiny-llama")

        proc.send_signal(signal.SIGTERM)  # the parent alone, as `docker stop` and the kubelet send it
        t0 = time.monotonic()
        took = wait_for(lambda: httpx.get(url + "/ready", timeout=5).status_code == 503, "/ready to turn 503",
                        timeout=30, interval=0.02)
        print(f"/ready answered 503 {took:.2f} s after SIGTERM")
        alive = {m: sum(s.is_alive() for s in streams if s.model == m) for m in STREAMS}
        print(f"streams in flight at the signal: {alive}")
        assert all(alive.values()), f"streams ended before the drain could be seen: {alive}"
        late = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "Late?"}]})
        assert late.status_code == 503 and late.headers.get("retry-after"), (late.status_code, late.text)
        rc = proc.wait(DRAIN_S + 60)
        print(f"tandem serve exited {rc} {time.monotonic() - t0:.1f} s after SIGTERM")
        assert rc == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            stop(proc)
    for s in streams:
        s.join(60)
    cut = [(s.model, s.i, s.finish, s.error) for s in streams if s.error or s.finish not in ("stop", "length")]
    assert not cut, cut
    assert all(s.text for s in streams)

    db = sqlite3.connect(tmp_path / "data" / "tandem.db")
    status, owner = db.execute("SELECT status, owner FROM batches WHERE id=?", (batch_id,)).fetchone()
    states = dict(db.execute("SELECT state, COUNT(*) FROM lines WHERE batch_id=? GROUP BY state", (batch_id,)))
    db.close()
    print(f"after the stop: batch {status}, lines {states}")
    assert status == "in_progress" and owner is None, (status, owner)  # not finalized; released at once
    assert "failed" not in states and 16 <= states.get("done", 0), states
    assert states.get("pending", 0) > 0, f"every line finished before the stop: nothing was tested ({states})"

    with running_stack({**config, "gateway": {**config["gateway"], "port": free_port()}}, tmp_path) as s:
        b = completed(s.client(timeout=300), batch_id, LINES)
        assert b.error_file_id is None
        assert _served_lines(s.url) <= states["pending"]  # what was answered before the stop was not redone
