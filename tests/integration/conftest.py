"""Integration tests share one real stack per session (``stack``): tiny-llama in vLLM and the
tiny diffusion model, behind `tandem serve` (``tests/integration/stack.py``)."""

from __future__ import annotations

import gc

import pytest

from tests.integration.stack import ENGINE_ARGS, REPO, Stack, running_stack
from tests.otlp_receiver import Receiver
from tests.unit.gateway_server import free_port


@pytest.fixture(scope="session")
def otlp() -> Receiver:
    """The OTLP/HTTP receiver the shared stack sends its traces to (gateway, replicas, vLLM)."""
    with Receiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def stack(tmp_path_factory, otlp) -> Stack:
    """Traced (``observability``): every test's requests go through the tracing path too."""
    tmp = tmp_path_factory.mktemp("stack")
    port = free_port()
    config = {
        "gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 2},
        "observability": {"otlp_traces_endpoint": otlp.endpoint},
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
    with running_stack(config, tmp) as s:
        yield s


@pytest.fixture(scope="module", autouse=True)
def _collect_before_each_module():
    """Collect garbage before a module's tests fork anything (Ray, servers): an in-process engine
    an earlier test left to the collector still holds its lazily allocated KV pool, and with the
    kernel's heuristic overcommit a fork of a process with that much address space can fail with
    ENOMEM (seen once: test_faults' ray.init)."""
    gc.collect()

