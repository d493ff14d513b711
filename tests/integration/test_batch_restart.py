"""A batch survives SIGKILL of `tandem serve` (issue 34): killed in the middle of a 300-line batch
on tiny-llama (the whole process group: gateway, Ray, vLLM), started again on the same config and
data dir, the batch resumes and completes; every `custom_id` appears exactly once, and the lines
answered before the kill are not sent again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import yaml

from tests.integration.stack import ENGINE_ARGS, READY_TIMEOUT_S, REPO, running_stack
from tests.unit.gateway_server import free_port
from tests.waiting import wait_for

LINES = 300


def _config(tmp_path) -> dict:
    return {
        "gateway": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 2},
        "ray": {"num_cpus": 2},
        "models_dir": str(REPO / "models"),
        "batches": {"data_dir": str(tmp_path / "data"), "lease_s": 3, "poll_s": 0.5},
        "models": [{"name": "tiny-llama", "kind": "autoregressive", "source": "builtin:tiny-llama",
                    "resources": {"num_gpus": 0, "num_cpus": 1}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                    "engine_args": ENGINE_ARGS}],
    }


def _completed_lines(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(r'^tandem_batch_lines_total\{outcome="completed"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_batch_resumes_after_sigkill_with_every_line_once(tmp_path):
    config = _config(tmp_path)
    url = f"http://127.0.0.1:{config['gateway']['port']}"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    log = tmp_path / "first.log"
    proc = subprocess.Popen([sys.executable, "-m", "tandem_tools.cli", "serve", "--config", str(cfg)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, process_group=0)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(url + "/ready", timeout=2).json().get("all_ready", False)
            except (httpx.HTTPError, ValueError):
                return False

        wait_for(ready, "the first tandem serve to be ready", timeout=READY_TIMEOUT_S, interval=1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "tiny-llama", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                           "messages": [{"role": "user", "content": f"Count to {i}."}]}} for i in range(LINES)]
        f = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = {}

        def some_lines_done() -> bool:
            done["n"] = client.batches.retrieve(batch.id).request_counts.completed
            return done["n"] >= 30

        wait_for(some_lines_done, "30 lines answered before the kill", timeout=300, interval=0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # gateway, Ray and vLLM at once: nothing drains
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert done["n"] < LINES, "the batch finished before the kill: nothing was tested"

    with running_stack(config, tmp_path) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        state = {}

        def completed() -> bool:
            state["b"] = client.batches.retrieve(batch.id)
            assert state["b"].status not in ("failed", "expired", "cancelled"), state["b"]
            return state["b"].status == "completed"

        wait_for(completed, "the resumed batch to complete", timeout=900, interval=1)
        b = state["b"]
        assert b.request_counts.completed == LINES and b.request_counts.failed == 0, b
        output = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        ids = [o["custom_id"] for o in output]
        assert len(ids) == LINES and set(ids) == {x["custom_id"] for x in lines}
        # This process answered only what was pending: the lines stored before the kill were not redone.
        assert _completed_lines(s.url) <= LINES - done["n"]
