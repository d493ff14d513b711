"""`tandem serve MODEL` as a new user runs it (issue 32 acceptance): tiny-llama under two names
with vLLM's flags, both names answering with the same greedy text; the tiny diffusion model with
its kind detected from its checkpoint. Each in its own process group, stopped after."""

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.stack import READY_TIMEOUT_S, REPO, stop
from tests.unit.gateway_server import free_port
from tests.waiting import wait_for

TANDEM = str(Path(sys.executable).parent / "tandem")


def _serve(tmp_path, *argv: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([TANDEM, "serve", *argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO, process_group=0)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"tandem serve exited {proc.returncode}:\n{(tmp_path / 'serve.log').read_text()[-3000:]}")
        try:
            r = httpx.get(url + "/ready", timeout=5)
            return r.status_code == 200 and r.json()["all_ready"]
        except httpx.HTTPError:
            return False

    wait_for(ready, f"tandem serve {argv[0]} to be ready", timeout=READY_TIMEOUT_S, interval=1)
    return proc, url


def test_serve_model_with_vllm_flags_serves_each_served_name(tmp_path):
    proc, url = _serve(tmp_path, "models/tiny-llama", "--served-model-name", "tl", "a2", "--max-model-len", "512",
                       "--dtype", "float32", "--enforce-eager")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tl", "a2"]
        answers = [client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=8, temperature=0) for name in ("tl", "a2")]
        assert all(a.model == "tl" for a in answers)  # as vLLM names its first served name
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        assert httpx.get(url + "/v1/models/a2", timeout=10).json()["max_model_len"] == 512
        log = (tmp_path / "serve.log").read_text()
        assert "vLLM engine on cpu, dtype float32, max_model_len 512, tensor_parallel_size 1" in log
    finally:
        stop(proc)


def test_serve_model_detects_a_diffusion_checkpoint(tmp_path):
    proc, url = _serve(tmp_path, "models/tiny-diffusiongemma")
    try:
        card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        assert (card["id"], card["kind"]) == ("models/tiny-diffusiongemma", "diffusion")
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "models/tiny-diffusiongemma", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert "diffusion engine on cpu, dtype float32, sampler exact" in (tmp_path / "serve.log").read_text()
    finally:
        stop(proc)
