"""Autoscaling on several Ray nodes (ray.cluster_utils.Cluster, fake GPUs, fake engines): a burst
scales a model from 1 replica to max_replicas, its requests complete or get 429 with Retry-After,
and idleness brings it back to min_replicas with no request lost; a drained replica's requests
finish before its actor goes; a replica that no node can hold is pending, with the reason, on
/admin/replicas and serves once a node is added.

Held load: the fake engines read a control file; ``{"*": "stall"}`` holds every replica, the
ones not created yet too (no token, no finishing; health checks pass), so the load stays up
exactly as long as the test says. Windows are short (config), waits are on conditions."""

import asyncio
import concurrent.futures as cf
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack import stop_group
from tests.unit.gateway_server import HeldStreams, fake_gateway, stream_outcome
from tests.waiting import wait_for

# alone under -n (tests/parallel.py): scaling decisions read from load
pytestmark = pytest.mark.alone

TOKENS = 8
LONG = 60  # tokens of the streams held mid-way (several are still running when the hold comes)
STALL_ALL = json.dumps({"*": "stall"})


@pytest.fixture
def cluster(request):
    """A head without GPUs (the gateway's driver) and ``request.param`` nodes of 1 GPU each."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(request.param):
        c.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=c.address)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _gateway(control, autoscaling: dict, gateway: dict | None = None, tokens: int = TOKENS, **model):
    from workers.deployment import RayDeployment

    extra = {"gateway": {"stall_timeout_s": 600, **(gateway or {})},
             "model_fields": {"resources": {"num_gpus": 1, "num_cpus": 0.5},
                              "engine_args": {"num_tokens": tokens, "token_delay_s": 0.05,
                                              "control_file": str(control)},
                              "autoscaling": {"interval_s": 0.1, **autoscaling}, **model}}
    return fake_gateway(extra=extra, deployment_factory=lambda cfg: RayDeployment(cfg, engine_key="fake"))


def _rows(url: str) -> list[dict]:
    return httpx.get(url + "/admin/replicas", timeout=30).json()["replicas"]


def _counts(url: str) -> dict:
    return httpx.get(url + "/v1/models/fake", timeout=30).json()["replicas"]


def _states(url: str) -> list[str]:
    return sorted(r["state"] for r in _rows(url))


def _engines_running(url: str) -> int:
    return sum(r.get("engine", {}).get("running", 0) for r in _rows(url))


def _metric(url: str, name: str, **labels) -> float | None:
    """One sample of /metrics (model ``fake``)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    want = {"model": "fake", **labels}
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name and s.labels == want), None)


def _outcome(url: str) -> str:
    """One streamed request: 'ok', '429 retry-after' (refused with the header), else what it got."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code == 429:
            return "429 retry-after" if int(r.headers.get("retry-after", "0")) >= 1 else "429 without retry-after"
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    ok = r.status_code == 200 and events[-1:] == ["[DONE]"] and sum("tok" in e for e in events) == TOKENS
    return "ok" if ok else f"bad: {r.status_code} {events[-3:]}"


@pytest.mark.parametrize("cluster", [3], indirect=True)
def test_a_burst_scales_up_to_max_and_idleness_back_to_min(cluster, tmp_path):
    """1 replica, 2 requests each, 4 queued: a burst of 10 held requests puts 6 on the model (the
    other 4 are refused with Retry-After); the load (6 > 1 x 1) scales it to 3 at once, the queued
    requests take the new replicas' slots; released, every accepted request completes, and the
    idle model comes back to 1 replica, one step per window."""
    control = tmp_path / "control.json"
    control.write_text(STALL_ALL)
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_in_flight_per_replica": 1,
                   "scale_up_window_s": 0.5, "scale_down_window_s": 0.5}
    with _gateway(control, autoscaling, gateway={"max_queue": 4}, max_in_flight_per_replica=2) \
            as (url, service, deployment):
        assert _counts(url) == {"total": 1, "healthy": 1, "desired": 1, "running": 1, "pending": 0, "draining": 0}
        with cf.ThreadPoolExecutor(10) as ex:
            futures = [ex.submit(_outcome, url) for _ in range(10)]
            wait_for(lambda: _counts(url)["desired"] == 3, "the burst to scale the model to max_replicas (3)")
            took = wait_for(lambda: _states(url) == ["healthy"] * 3, "the new replicas to serve", timeout=180)
            print(f"scaled 1 -> 3 and serving {took:.1f} s after the decision")
            wait_for(lambda: _engines_running(url) == 6, "the queued requests to reach the new replicas")
            control.write_text("{}")
            results = sorted(f.result(timeout=300) for f in futures)
        assert results.count("ok") >= 6 and set(results) <= {"ok", "429 retry-after"}, results
        took = wait_for(lambda: _states(url) == ["healthy"], "the idle model to scale back to 1 replica", timeout=120)
        print(f"back to 1 replica {took:.1f} s after the burst ended")
        assert len(deployment._actors) == 1  # the removed replicas' actors are released
        assert _metric(url, "tandem_scale_events_total", direction="down") == 2
        assert _metric(url, "tandem_replicas_desired") == _metric(url, "tandem_replicas_running") == 1
        assert [_outcome(url) for _ in range(2)] == ["ok", "ok"]


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_removed_replica_finishes_its_requests_before_its_actor_goes(cluster, tmp_path):
    """The scale-down path on Ray actors: streams held on the victim; while it drains it gets no
    new request, /admin/replicas says `draining`; released, its streams complete; then its actor
    is killed for good (Ray does not restart it)."""
    import ray

    control = tmp_path / "control.json"
    control.write_text("{}")
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "interval_s": 3600}  # the test drains by hand
    with _gateway(control, autoscaling, tokens=LONG, replicas=2) as (url, service, deployment):
        wait_for(lambda: _states(url) == ["healthy"] * 2, "both replicas to serve", timeout=180)
        pool = service.router.pools["fake"]
        victim, survivor = pool.replicas
        actor = deployment._actors[victim.id]
        pid = asyncio.run_coroutine_threadsafe(victim.handle.describe(), service.loop).result(30)["pid"]
        with cf.ThreadPoolExecutor(6) as ex:
            held = HeldStreams(ex, url, victim.id, lambda: control.write_text(json.dumps({str(pid): "stall"})),
                               lambda: next(r for r in _rows(url) if r["id"] == victim.id)["engine"]["running"],
                               6, LONG)
            assert held.held >= 1, "p2c over two replicas puts streams on both"
            drained = asyncio.run_coroutine_threadsafe(service.supervisor.scaling.drain_and_remove(victim), service.loop)
            wait_for(lambda: next(r for r in _rows(url) if r["id"] == victim.id)["state"] == "draining",
                     "/admin/replicas to show the victim draining")
            served = {}
            assert stream_outcome(url, LONG, served=served, timeout=120) == "ok"
            assert served["replica"] == survivor.id
            assert not drained.done()
            control.write_text("{}")
            assert [f.result(timeout=300) for f in held.futures] == ["ok"] * 6
            drained.result(timeout=120)
        assert [r["id"] for r in _rows(url)] == [survivor.id]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_id.remote(), timeout=60)


@pytest.mark.parametrize("cluster", [1], indirect=True)
def test_a_replica_no_node_can_hold_is_pending_until_a_node_is_added(cluster, tmp_path):
    control = tmp_path / "control.json"
    control.write_text(STALL_ALL)
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "target_in_flight_per_replica": 1,
                   "scale_up_window_s": 0.2, "scale_down_window_s": 600}
    with _gateway(control, autoscaling) as (url, service, deployment):
        with cf.ThreadPoolExecutor(3) as ex:
            futures = [ex.submit(_outcome, url) for _ in range(3)]
            wait_for(lambda: _counts(url)["desired"] == 2, "the load to ask for a second replica")
            wait_for(lambda: "pending" in _states(url), "/admin/replicas to show the new replica pending")
            pending = next(r for r in _rows(url) if r["state"] == "pending")
            assert "GPU 1" in pending["error"], pending
            assert _counts(url) == {"total": 2, "healthy": 1, "desired": 2, "running": 1, "pending": 1,
                                    "draining": 0}
            assert _metric(url, "tandem_replicas_pending") == 1
            cluster.add_node(num_cpus=1, num_gpus=1)
            took = wait_for(lambda: _states(url) == ["healthy"] * 2, "the pending replica to serve on the new node",
                            timeout=180)
            print(f"pending replica serving {took:.1f} s after the node was added")
            control.write_text("{}")
            assert [f.result(timeout=300) for f in futures] == ["ok"] * 3


def _pinned_clients(url: str, processes: int = 2, each: int = 3) -> list[list[httpx.Client]]:
    """``each`` keep-alive connections (one request at a time each) to every gateway process (the
    kernel picks the process of a new connection; the ``x-tandem-gateway`` header names it)."""
    found: dict[int, list[httpx.Client]] = {}
    for _ in range(400):
        c = httpx.Client(base_url=url, limits=httpx.Limits(max_connections=1), timeout=120)
        mine = found.setdefault(int(c.get("/health").headers["x-tandem-gateway"]), [])
        if len(mine) < each:
            mine.append(c)
        else:
            c.close()
        if len(found) == processes and all(len(cs) == each for cs in found.values()):
            return list(found.values())
    raise AssertionError(f"connections per gateway process after 400 tries: {[len(cs) for cs in found.values()]}")


def _view(client: httpx.Client) -> list[tuple[str, str]]:
    """(replica id, state) as one gateway process sees them."""
    return sorted((r["id"], r["state"]) for r in client.get("/admin/replicas").json()["replicas"])


def _stream_via(client: httpx.Client) -> str:
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    ok = r.status_code == 200 and events[-1:] == ["[DONE]"] and sum("tok" in e for e in events) == TOKENS
    return "ok" if ok else f"bad: {r.status_code} {events[-3:]}"


def test_two_gateway_processes_follow_the_owner_up_and_down(tmp_path):
    """`gateway.processes: 2`: held streams through both processes scale the model 1 -> 3 (the
    owner counts every process's requests on the replicas); each process serves the new replicas;
    then, with a request at a time going through either process the whole while, the model comes
    back to 1 replica and every one of those requests completes."""
    import subprocess
    import sys
    import threading

    import yaml

    from tests.unit.gateway_server import free_port

    port = free_port()
    control = tmp_path / "control.json"
    control.write_text(STALL_ALL)
    config = {
        "gateway": {"host": "127.0.0.1", "port": port, "processes": 2, "health_interval_s": 0.5,
                    "drain_timeout_s": 60, "stall_timeout_s": 600},
        "ray": {"num_cpus": 2},
        "models": [{"name": "fake", "kind": "autoregressive", "source": "none",
                    "resources": {"num_cpus": 0.5, "num_gpus": 0},
                    "engine_args": {"num_tokens": TOKENS, "token_delay_s": 0.02, "control_file": str(control)},
                    "autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_in_flight_per_replica": 1,
                                    "scale_up_window_s": 0.3, "scale_down_window_s": 0.5, "interval_s": 0.1}}],
    }
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.processes_serve", str(cfg)],
                                cwd=Path(__file__).resolve().parents[2], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, f"the gateway exited early:\n{log.read_text()[-4000:]}"
        try:
            r = httpx.get(url + "/ready", timeout=30)  # 200 once one model serves: wait for all
            return r.status_code == 200 and r.json()["all_ready"]
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, "the gateway processes to be ready", timeout=180)
        pinned = _pinned_clients(url)  # per process: one to look, two to stream
        clients = [cs[0] for cs in pinned]
        one = [("fake/0", "healthy")]
        for c in clients:
            wait_for(lambda c=c: _view(c) == one, "each process to serve the one replica")
        with cf.ThreadPoolExecutor(4) as ex:
            held = [ex.submit(_stream_via, c) for cs in pinned for c in cs[1:]]
            for c in clients:  # (ids aside: a replica replaced on the way up is still one of three)
                try:
                    wait_for(lambda c=c: [s for _, s in _view(c)] == ["healthy"] * 3,
                             "each process to serve 3 healthy replicas", timeout=180)
                except AssertionError as e:
                    views = [_view(x) for x in clients]
                    raise AssertionError(f"{e}; views {views}; gateway log:\n{log.read_text()[-6000:]}") from None
            control.write_text("{}")
            assert [f.result(timeout=300) for f in held] == ["ok"] * 4
        results: list[str] = []
        done = threading.Event()

        def one_at_a_time() -> None:
            i = 0
            while not done.is_set():
                results.append(_stream_via(pinned[i % 2][1]))
                i += 1

        traffic = threading.Thread(target=one_at_a_time)
        traffic.start()
        try:
            for c in clients:
                wait_for(lambda c=c: len(_view(c)) == 1, "each process to be back to 1 replica", timeout=180)
        finally:
            done.set()
            traffic.join(300)
        print(f"{len(results)} requests while scaling down 3 -> 1")
        assert results and set(results) == {"ok"}, results
    finally:
        for cs in locals().get("pinned", []):
            for c in cs:
                c.close()
        stop_group(proc)
