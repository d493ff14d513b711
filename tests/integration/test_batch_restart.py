"""A batch survives SIGKILL of `tandem serve` (issue 34): killed in the middle of a 120-line batch
on tiny-llama (the whole process group: gateway, Ray, vLLM), started again on the same config and
data dir, the batch resumes and completes; every `custom_id` appears exactly once, and the lines
answered before the kill are not sent again."""

from __future__ import annotations

import os
import re
import signal

import httpx
import openai
import pytest

from tests.batches import answered, chat_lines, completed, submit
from tests.integration.stack import ENGINE_ARGS, REPO, launch_config, running_stack
from tests.unit.gateway_server import free_port

# alone under -n (tests/parallel.py): a SIGKILL mid-batch and a lease taken over
pytestmark = pytest.mark.alone

LINES = 120  # 16 in flight (batches.lines_in_flight): killed after 30, most still pending


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
    proc, first = launch_config(config, tmp_path, "first.log")
    try:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="none", max_retries=0)
        lines = chat_lines(LINES, "tiny-llama", max_tokens=32, temperature=0, ignore_eos=True)
        batch_id = submit(client, lines)
        done = answered(client, batch_id, 30)
        os.killpg(proc.pid, signal.SIGKILL)  # gateway, Ray and vLLM at once: nothing drains
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert done < LINES, "the batch finished before the kill: nothing was tested"

    with running_stack(config, tmp_path) as s:
        completed(s.client(timeout=300), batch_id, LINES)
        # This process answered only what was pending: the lines stored before the kill were not redone.
        assert _completed_lines(s.url) <= LINES - done
