"""Fault injection on real Ray actors (local Ray; fake engines, since the subject is the
gateway's and Ray's handling of failures, not vLLM):

- a replica's actor killed mid-stream, an engine that hangs, one that stalls (health checks
  pass, no tokens), one that raises: the requests on it end with an error (or, not yet
  answered, are retried elsewhere), the others complete, the replica leaves the rotation and
  is back, in a new process, after Ray restarts it;
- a replica that cannot be placed is reported in /ready and /metrics, not waited on silently;
- a bounded load test: thousands of requests through 2 replicas, one killed in the middle;
  every request gets a whole answer or an error, none is lost.
"""

import asyncio
import concurrent.futures as cf
import json
import threading
import time

import httpx
import pytest

from gateway.routing.replicas import ReplicaState
from tests.unit.gateway_server import HeldStreams, complete_outcome, fake_gateway, stream_outcome
from tests.waiting import wait_for

# alone under -n (tests/parallel.py): killed and stalled replicas found by health checks
pytestmark = pytest.mark.alone

TOKENS = 20
# stall_timeout_s: far above how long a test holds a replica before its fault (no progress then
# is the test's doing, not the fault under test), yet short enough for the stall test.
GATEWAY = {"health_interval_s": 0.5, "stall_timeout_s": 10.0, "unhealthy_after": 2}
CPU_REPLICA = {"resources": {"num_gpus": 0, "num_cpus": 1}}


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, namespace="tandem-faults")
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def gw(ray_local, tmp_path_factory):
    from workers.deployment import RayDeployment

    control = tmp_path_factory.mktemp("faults") / "control.json"
    control.write_text("{}")
    extra = {"gateway": GATEWAY,
             "model_fields": {**CPU_REPLICA, "engine_args": {"num_tokens": TOKENS, "token_delay_s": 0.05,
                                                             "control_file": str(control)}}}
    with fake_gateway(replicas=2, extra=extra,
                      deployment_factory=lambda cfg: RayDeployment(cfg, engine_key="fake")) as (url, service, _):
        yield url, service, control


def _wait_for(cond, timeout: float, what: str) -> float:
    return wait_for(cond, what, timeout=max(timeout, 60))  # generous: a slow box only waits longer


def _describe(service, replica) -> dict:
    return asyncio.run_coroutine_threadsafe(replica.handle.describe(), service.loop).result(30)


def _both_healthy(service) -> None:
    _wait_for(lambda: len(service.router.pools["fake"].healthy()) == 2, 90, "replicas not both healthy")


def _engine_running(service, replica) -> int:
    return asyncio.run_coroutine_threadsafe(replica.handle.stats(), service.loop).result(10).running


def _retries(service) -> float:
    return service.metrics.retries.labels("fake")._value.get()


def _held(ex, url, service, control, victim, pid: int, n: int) -> HeldStreams:
    return HeldStreams(ex, url, victim.id, lambda: control.write_text(json.dumps({str(pid): "stall"})),
                       lambda: _engine_running(service, victim), n, TOKENS)


def test_actor_killed_mid_stream(gw):
    import ray

    url, service, control = gw
    _both_healthy(service)
    victim = service.router.pools["fake"].replicas[0]
    before = _describe(service, victim)
    restarts, retries = victim.restarts, _retries(service)
    with cf.ThreadPoolExecutor(12) as ex:
        streams = _held(ex, url, service, control, victim, before["pid"], 6)
        plain = [ex.submit(complete_outcome, url, TOKENS) for _ in range(4)]
        # those on the survivor finish; those on the victim are held, unanswered
        _wait_for(lambda: sum(f.done() for f in plain) + _engine_running(service, victim) - streams.held == 4, 60,
                  "the non-streamed requests to be answered or held")
        plain_on_victim = _engine_running(service, victim) - streams.held
        ray.kill(victim.handle.actor, no_restart=False)
        _wait_for(lambda: victim.restarts > restarts, 60, "the dead replica to leave the rotation")
        streams.check()
        plain_results = [f.result(timeout=120) for f in plain]
    assert plain_results == ["ok"] * 4  # unanswered: retried on the survivor
    assert _retries(service) - retries == plain_on_victim
    _wait_for(lambda: victim.state is ReplicaState.HEALTHY, 90, "the replica did not come back")
    after = _describe(service, victim)
    assert after["pid"] != before["pid"] and after["incarnation"] != before["incarnation"]  # Ray restarted it
    assert [complete_outcome(url, TOKENS) for _ in range(4)] == ["ok"] * 4


@pytest.mark.parametrize("fault", ["hang", "stall", "raise"])
def test_failing_engine_in_an_actor(gw, fault):
    url, service, control = gw
    _both_healthy(service)
    victim = service.router.pools["fake"].replicas[0]
    before = _describe(service, victim)
    restarts = victim.restarts
    with cf.ThreadPoolExecutor(8) as ex:
        streams = _held(ex, url, service, control, victim, before["pid"], 6)
        control.write_text(json.dumps({str(before["pid"]): fault}))
        out_after = _wait_for(lambda: victim.state is not ReplicaState.HEALTHY or victim.restarts > restarts, 60,
                              "the failing replica to leave the rotation")
        streams.check()
    _wait_for(lambda: victim.state is ReplicaState.HEALTHY and victim.restarts > restarts, 90,
              "the replica did not come back")
    assert _describe(service, victim)["pid"] != before["pid"]  # killed and restarted by Ray
    assert [stream_outcome(url, TOKENS) for _ in range(4)] == ["ok"] * 4
    # a figure, not a bound: stall_timeout_s + a few health intervals on an idle box
    print(f"{fault}: out of rotation after {out_after:.2f} s")


def test_unplaceable_replica_is_reported(ray_local):
    """num_gpus: 1 on a Ray cluster without GPUs: /ready says so (state pending, the reason), so
    does /metrics; nothing hangs."""
    from workers.deployment import RayDeployment

    # ray.address: a cluster, which may grow (a local Ray of fixed nodes refuses the start instead:
    # test_placement_groups.py)
    extra = {"gateway": {"health_interval_s": 0.5}, "ray": {"address": "auto"},
             "model_fields": {"resources": {"num_gpus": 1, "num_cpus": 1}}}
    with fake_gateway(extra=extra, wait_ready=False,
                      deployment_factory=lambda cfg: RayDeployment(cfg, engine_key="fake")) as (url, service, _):
        _wait_for(lambda: service.router.pools["fake"].replicas[0].state is ReplicaState.PENDING, 20,
                  "never reported as pending")
        r = httpx.get(url + "/ready", timeout=5)
        assert r.status_code == 503
        row = r.json()["models"]["fake"]["replicas"][0]
        assert row["state"] == "pending" and "GPU 1" in row["error"] and "GPU 0" in row["error"]
        _wait_for(lambda: 'tandem_replicas{model="fake",state="pending"} 1.0' in httpx.get(url + "/metrics").text,
                  10, "pending replica not in /metrics")
        err = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=5)
        assert err.status_code == 503 and err.json()["error"]["type"] == "service_unavailable_error"


# -- the bounded load test -------------------------------------------------------------------

LOAD_REQUESTS = 3000
LOAD_CONCURRENCY = 32
LOAD_TIME_LIMIT_S = 240


async def _one(client: httpx.AsyncClient, i: int) -> str:
    """'ok', 'error', or 'lost' (no whole answer and no error: silence, truncation, garbage)."""
    stream = i % 2 == 0
    body = {"model": "fake", "messages": [{"role": "user", "content": f"request {i}"}], "stream": stream,
            "max_tokens": 4}
    try:
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            if r.status_code == 200:
                return "ok" if r.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3" else "lost"
            return "error" if "error" in r.json() else "lost"
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return "error" if "error" in r.json() else "lost"
            events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "lost"
        if any('"error"' in e for e in events[:-1]):
            return "error"
        return "ok" if sum('"tok' in e for e in events) == 4 else "lost"
    except (httpx.HTTPError, ValueError, KeyError):
        return "lost"


async def _load(url: str, kill_at: int, kill) -> tuple[list[str], float]:
    results: list[str] = []
    next_i = 0
    limits = httpx.Limits(max_connections=LOAD_CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        async def worker():
            nonlocal next_i
            while next_i < LOAD_REQUESTS:
                i, next_i = next_i, next_i + 1
                if i == kill_at:
                    kill()
                results.append(await _one(client, i))

        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(LOAD_CONCURRENCY))), LOAD_TIME_LIMIT_S)
        return results, time.monotonic() - t0


def test_load_with_a_replica_killed_in_the_middle_loses_nothing(gw):
    import ray

    url, service, _ = gw
    _both_healthy(service)
    victim = service.router.pools["fake"].replicas[0]
    restarts = victim.restarts
    killed = threading.Event()

    def kill():
        ray.kill(victim.handle.actor, no_restart=False)
        killed.set()

    results, wall = asyncio.run(_load(url, LOAD_REQUESTS // 2, kill))
    report = {k: results.count(k) for k in ("ok", "error", "lost")}
    print(f"\nload test: sent {len(results)}, completed {report['ok']}, errored {report['error']}, "
          f"lost {report['lost']} in {wall:.1f} s ({len(results) / wall:.0f} req/s); "
          f"retried {service.metrics.retries.labels('fake')._value.get():.0f}")
    assert killed.is_set()
    _wait_for(lambda: victim.restarts > restarts, 60, "the killed replica to be restarted")
    assert len(results) == LOAD_REQUESTS and report["lost"] == 0, report
    assert report["ok"] >= LOAD_REQUESTS * 0.95, report  # only what was on the dead replica mid-stream fails
    _wait_for(lambda: victim.state is ReplicaState.HEALTHY, 90, "the killed replica did not come back")
