"""The real stack, started once per test session: `tandem serve` (local Ray, vLLM on
tiny-llama in a Ray actor, the gateway on a free port), talked to over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.unit.gateway_server import free_port

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = float(os.environ.get("TANDEM_TEST_READY_TIMEOUT_S", "600"))
ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 64, "dtype": "float32"}


class Stack:
    def __init__(self, url: str, log: Path, config: dict):
        self.url = url
        self.log = log
        self.config = config

    @property
    def model_path(self) -> Path:
        return REPO / "models" / "tiny-llama"

    @property
    def diffusion_path(self) -> Path:
        return REPO / "models" / "tiny-diffusiongemma"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def completion_text(self, model: str, prompt: str, max_tokens: int, stream: bool, **kw) -> str:
        """One completion's text, streamed (the deltas joined) or not."""
        c = self.client()
        if not stream:
            return c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **kw).choices[0].text
        chunks = c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **kw)
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)

    def replica_stats(self, model: str = "tiny-llama") -> list[dict]:
        rows = httpx.get(self.url + "/admin/replicas", timeout=10).json()["replicas"]
        return [r for r in rows if r["model"] == model]

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the group left behind (Ray, vLLM)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("stack")
    port = free_port()
    config = {
        "gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 2},
        "ray": {"num_cpus": 2},
        "models_dir": str(REPO / "models"),
        "models": [{
            "name": "tiny-llama", "kind": "autoregressive", "source": "builtin:tiny-llama",
            "resources": {"num_gpus": 0, "num_cpus": 1},
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "engine_args": ENGINE_ARGS,
        }, {
            "name": "tiny-diffusiongemma", "kind": "diffusion", "source": "builtin:tiny-diffusiongemma",
            "resources": {"num_gpus": 0, "num_cpus": 1},
            "engine_args": {"family": "diffusiongemma", "max_batch": 8, "max_images": 4,
                            "max_image_bytes": 200_000, "max_image_pixels": 1_000_000},
        }],
    }
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    log = tmp / "serve.log"
    # A new process group (not a new session): one signal reaches Ray and vLLM too.
    proc = subprocess.Popen([sys.executable, "-m", "tandem_tools.cli", "serve", "--config", str(cfg_path)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, process_group=0)
    s = Stack(f"http://127.0.0.1:{port}", log, config)
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tandem serve exited with {proc.returncode}:\n{s.log_tail()}")
            try:
                if httpx.get(s.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tandem did not become ready in {READY_TIMEOUT_S:.0f} s:\n{s.log_tail()}")
            time.sleep(1)  # a poll interval of the wait above (deadline, loud failure)
        yield s
    finally:
        _stop(proc)
