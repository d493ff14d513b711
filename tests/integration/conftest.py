"""Integration tests share one real stack per session (``stack``): tiny-llama in vLLM and the
tiny diffusion model, behind `tandem serve` (``tests/integration/stack.py``)."""

from __future__ import annotations

import gc

import pytest
import yaml

from tests.integration.stack import ENGINE_ARGS, REPO, Stack, running_stack, serving
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


@pytest.fixture(scope="session")
def default_stack(tmp_path_factory) -> Stack:
    """``configs/default.yaml`` served exactly as ``make serve`` serves it: `tandem serve` with no
    config, from the repository root, only ``--port`` added (``make serve ARGS="--port P"``), the
    batch store in a folder of the run. Shared by the shipped config's tests
    (``test_default_config.py``) and the tests that need its diffusion model's gemma4 tool and
    reasoning parsers (``test_default_config_tools.py``; the shared stack's has none). It stops
    after its last test (``ENDS_AFTER_LAST_USE``)."""
    tmp = tmp_path_factory.mktemp("config-default")
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    port = free_port()
    with serving(["--port", str(port)], port, tmp, config, env={"XDG_STATE_HOME": str(tmp / "state")}) as s:
        yield s


# Session stacks that stop after the last test that uses them, not at the session's end: a run
# then holds no more stacks at once than it needs (each is a few GiB): the unit tests run with none.
ENDS_AFTER_LAST_USE = ("default_stack", "stack")


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's own teardown first (its module's fixtures on this stack)
    for name in ENDS_AFTER_LAST_USE:
        if name in item.fixturenames and not any(name in later.fixturenames for later in _after(item)):
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                fixturedef.finish(item._request)  # pytest's own teardown at the session's end then finds it done


def _after(item) -> list:
    items = item.session.items
    return items[items.index(item) + 1:]


@pytest.fixture(scope="module", autouse=True)
def _collect_before_each_module():
    """Collect garbage before a module's tests fork anything (Ray, servers): an in-process engine
    an earlier test left to the collector still holds its lazily allocated KV pool, and with the
    kernel's heuristic overcommit a fork of a process with that much address space can fail with
    ENOMEM (seen once: test_faults' ray.init)."""
    gc.collect()

