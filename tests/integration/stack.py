"""The real stack for integration tests: `tandem serve` in its own process group, and a
client-side handle on it (shared by ``conftest.py``'s session stack and tests that need a
stack of their own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.waiting import wait_for

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


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s whole process group (every gateway process drains), SIGKILL to
    what is left after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def stop(proc: subprocess.Popen) -> None:
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




@contextmanager
def running_stack(config: dict, tmp: Path) -> Iterator[Stack]:
    """`tandem serve` on ``config`` (its gateway.port set), ready, until the block ends."""
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    with serving(["--config", str(cfg_path)], config["gateway"]["port"], tmp, config) as s:
        yield s


@contextmanager
def serving(args: list[str], port: int, tmp: Path, config: dict, env: dict | None = None) -> Iterator[Stack]:
    """`tandem serve ARGS` from the repository root (as `make serve` runs it), listening on
    ``port``, every model ready, until the block ends; ``config``: what it serves (the Stack's)."""
    proc, s = launch(args, port, tmp, config, env)
    try:
        yield s
    finally:
        stop(proc)


def launch(args: list[str], port: int, tmp: Path, config: dict, env: dict | None = None,
           log_name: str = "serve.log") -> tuple[subprocess.Popen, Stack]:
    """`tandem serve ARGS` started in a process group of its own (not a new session: one signal
    reaches Ray and vLLM too), every model ready: (the process, its Stack). The caller stops it
    (``stop``), or signals it itself (a test of how it stops)."""
    log = tmp / log_name
    proc = subprocess.Popen([sys.executable, "-m", "tandem_tools.cli", "serve", *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, process_group=0,
                            env={**os.environ, **(env or {})})
    s = Stack(f"http://127.0.0.1:{port}", log, config)

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"tandem serve exited with {proc.returncode}:\n{s.log_tail()}")
        try:
            r = httpx.get(s.url + "/ready", timeout=2)  # 200 once one model serves: wait for all of them
            return r.status_code == 200 and r.json()["all_ready"]
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, "tandem is ready", timeout=READY_TIMEOUT_S, interval=1)
    except AssertionError as e:
        stop(proc)
        pytest.fail(f"{e}\n{s.log_tail()}")
    return proc, s


def launch_config(config: dict, tmp: Path, log_name: str = "serve.log") -> tuple[subprocess.Popen, Stack]:
    """``launch`` on ``config`` (written under ``tmp``; its gateway.port set)."""
    path = tmp / f"{Path(log_name).stem}.yaml"
    path.write_text(yaml.safe_dump(config))
    return launch(["--config", str(path)], config["gateway"]["port"], tmp, config, log_name=log_name)


@contextmanager
def ray_cluster(head: dict, nodes: list[dict]) -> Iterator[tuple[object, list]]:
    """A Ray cluster of several nodes on this machine (``ray.cluster_utils``: fake GPUs allowed),
    this process connected to it: (cluster, the added nodes). Shut down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=head)
    added = [c.add_node(**n) for n in nodes]
    ray.init(address=c.address)
    c.wait_for_nodes()
    try:
        yield c, added
    finally:
        ray.shutdown()
        c.shutdown()
