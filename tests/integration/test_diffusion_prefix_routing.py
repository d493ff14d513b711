"""`routing: prefix` on a diffusion model with two replicas (fast sampler, prefix cache on): the
gateway's engine-agnostic prefix index keeps each tenant on the replica that holds its system
prompt's pages, where its later requests hit (``cached_tokens``, the replicas' counters)."""

import httpx
import pytest

from diffusion_plugin.batcher.memory import PAGE_TOKENS
from tests.integration.stack import REPO, running_stack
from tests.unit.gateway_server import free_port
from tests.waiting import wait_for

MODEL = "tiny-diffusiongemma"
PAGE = PAGE_TOKENS  # the diffusion KV page
TENANTS, ROUNDS = 4, 3


@pytest.fixture(scope="module")
def prefix_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diffusion-prefix")
    config = {"gateway": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 2},
              "ray": {"num_cpus": 2},
              "models_dir": str(REPO / "models"),
              "models": [{"name": MODEL, "kind": "diffusion", "source": "builtin:tiny-diffusiongemma",
                          "replicas": 2, "routing": "prefix", "resources": {"num_gpus": 0, "num_cpus": 1},
                          "engine_args": {"sampler": "fast", "max_batch": 4}}]}
    with running_stack(config, tmp) as s:
        yield s


def _system(tenant: int) -> str:
    """~700 tokens (two whole pages and more) that no other tenant's prompt shares from its start."""
    return f"Tenant {tenant} rules. " + " ".join(f"t{tenant}w{(i * 7919 + tenant) % 10007}" for i in range(200))


def _counters(stack) -> dict[str, tuple[int, int]]:
    """Each replica's prefix-cache counters. A replica whose stats call timed out (5 s: a loaded
    box) shows ``engine_error`` instead of ``engine`` for that look: look again."""
    found: dict = {}

    def read() -> bool:
        rows = [r for r in httpx.get(stack.url + "/admin/replicas", timeout=30).json()["replicas"]
                if r["model"] == MODEL]
        found["rows"] = rows
        return all("engine" in r for r in rows)

    wait_for(read, "every replica's engine counters in /admin/replicas", timeout=120, interval=1)
    return {r["id"]: (r["engine"]["prefix_cache_queries"], r["engine"]["prefix_cache_hits"]) for r in found["rows"]}


def test_each_tenant_stays_on_one_replica_and_hits_there(prefix_stack):
    before = _counters(prefix_stack)
    assert len(before) == 2
    replicas: dict[int, set[str]] = {t: set() for t in range(TENANTS)}
    for rnd in range(ROUNDS):
        for tenant in range(TENANTS):
            r = httpx.post(prefix_stack.url + "/v1/chat/completions", timeout=300, json={
                "model": MODEL, "max_tokens": 4, "seed": rnd, "diffusion": {"max_denoising_steps": 2},
                "messages": [{"role": "system", "content": _system(tenant)},
                             {"role": "user", "content": f"Question {rnd} of tenant {tenant}?"}]})
            assert r.status_code == 200, r.text
            replicas[tenant].add(r.headers["x-tandem-replica"])
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if rnd > 0:  # its replica computed this prompt's leading pages in round 0
                assert cached >= 2 * PAGE, (tenant, rnd, cached)
    assert all(len(seen) == 1 for seen in replicas.values()), replicas
    after = _counters(prefix_stack)
    hits = {rid: after[rid][1] - before[rid][1] for rid in after}
    queries = {rid: after[rid][0] - before[rid][0] for rid in after}
    # every request after a tenant's first hit its two whole pages at least
    assert sum(hits.values()) >= TENANTS * (ROUNDS - 1) * 2 * PAGE, (hits, queries)
    assert sum(queries.values()) > sum(hits.values())
