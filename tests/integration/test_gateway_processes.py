"""Two gateway processes (`gateway.processes: 2`) in front of the same replicas: fake engines in
real Ray actors, real processes, one shared listening socket.

Which process takes a connection is the kernel's choice: every test finds out from the
``x-tandem-gateway`` header and pins one keep-alive connection to each process (public /health
requests on fresh connections until both pids are seen, bounded); nothing assumes a placement,
and nothing waits on time (streams are held with the fake engine's control file)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.stack import stop_group
from tests.unit.gateway_server import free_port
from tests.waiting import wait_for

# alone under -n (tests/parallel.py): gateway processes killed and drained
pytestmark = pytest.mark.alone

REPO = Path(__file__).resolve().parents[2]
TOKENS = 20
KEY = "sk-test-processes-0123456789"
PIN_TRIES = 200


class Group:
    def __init__(self, proc: subprocess.Popen, url: str, control: Path, log: Path):
        self.proc, self.url, self.control, self.log = proc, url, control, log
        self.health_requests = 0

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"the gateway exited early:\n{self.log_tail()}"
        try:
            r = httpx.get(self.url + "/ready", timeout=30)  # 200 once one model serves: wait for all
            return r.status_code == 200 and r.json()["all_ready"]
        except httpx.HTTPError:
            return False

    def pinned_clients(self, n: int = 2) -> dict[int, httpx.Client]:
        """One keep-alive connection per gateway process: {pid: client}."""
        return {pid: cs[0] for pid, cs in self.pinned_pools(1, n).items()}

    def pinned_pools(self, per_process: int, n: int = 2) -> dict[int, list[httpx.Client]]:
        """``per_process`` keep-alive connections to each of the ``n`` gateway processes."""
        found: dict[int, list[httpx.Client]] = {}
        for _ in range(PIN_TRIES * per_process):
            c = httpx.Client(base_url=self.url, limits=httpx.Limits(max_connections=1), timeout=120)
            pid = int(c.get("/health").headers["x-tandem-gateway"])
            self.health_requests += 1
            if len(found.setdefault(pid, [])) >= per_process:
                c.close()
            else:
                found[pid].append(c)
            if len(found) == n and all(len(cs) == per_process for cs in found.values()):
                # /ready answered by one of them said nothing of the others, and ready means a
                # healthy replica per model: wait until each process sees every replica healthy.
                for fpid, (fc, *_) in found.items():
                    wait_for(lambda fc=fc: _all_healthy(fc.get("/ready").json()),
                             f"gateway process {fpid} to see every replica healthy", timeout=180)
                return found
        raise AssertionError(f"pinned only {({p: len(cs) for p, cs in found.items()})} connections in "
                             f"{PIN_TRIES * per_process} tries")

    def replica_pids(self, client: httpx.Client | None = None) -> dict[str, int]:
        rows = (client or httpx).get(self.url + "/admin/replicas", timeout=60).json()["replicas"]
        assert all("pid" in r for r in rows), rows
        return {r["id"]: r["pid"] for r in rows}

    def running(self) -> int:
        """Requests the engines hold (asked on a new connection: any process knows)."""
        rows = httpx.get(self.url + "/admin/replicas", timeout=60).json()["replicas"]
        return sum(r.get("engine", {}).get("running", 0) for r in rows)

    def channels(self) -> dict[str, set[str]]:
        """Each replica's open channels (one per gateway process, and the parent's)."""
        rows = httpx.get(self.url + "/admin/replicas", timeout=60).json()["replicas"]
        return {r["id"]: set(r["engine"]["channel_in_flight"]) for r in rows}

    def hold(self, pids) -> None:
        self.control.write_text(json.dumps({str(p): "stall" for p in pids}))

    def release(self) -> None:
        self.control.write_text("{}")


def _all_healthy(ready: dict) -> bool:
    return all(r["state"] == "healthy" for m in ready["models"].values() for r in m["replicas"])


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


@contextmanager
def gateway_group(tmp_path: Path, processes: int = 2, requests_per_minute: int | None = None,
                  metrics_port: int | None = None, keys: list[dict] = (), model_fields: dict | None = None):
    port = free_port()
    control = tmp_path / "control.json"
    control.write_text("{}")
    config = {
        "gateway": {"host": "127.0.0.1", "port": port, "processes": processes, "health_interval_s": 0.5,
                    "drain_timeout_s": 60, "stall_timeout_s": 600},
        "ray": {"num_cpus": 2},
        "metrics": {"port": metrics_port},
        "auth": {"api_keys": [{"key": KEY, "name": "test", "requests_per_minute": requests_per_minute}, *keys],
                 "public_paths": ["/health", "/metrics", "/admin/replicas"]},
        "models": [{"name": "fake", "kind": "autoregressive", "source": "none", "replicas": 2,
                    "resources": {"num_cpus": 0.5, "num_gpus": 0},
                    "engine_args": {"num_tokens": TOKENS, "token_delay_s": 0.01, "control_file": str(control)},
                    **(model_fields or {})}],
    }
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.processes_serve", str(cfg)], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    group = Group(proc, f"http://127.0.0.1:{port}", control, log)
    try:
        wait_for(group.ready, "the gateway processes to be ready", timeout=180)
        yield group
    finally:
        group.release()
        stop_group(proc)


def _stream(client: httpx.Client, key: str = KEY) -> str:
    """'ok' (the whole answer), 'error' (an error status or event), else 'broken: ...'."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True}
    events = []
    try:
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                return "error"
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    events.append(ln[6:])
    except httpx.HTTPError as e:
        return f"broken: {type(e).__name__}"
    if events and events[-1] == "[DONE]" and sum("tok" in e for e in events) == TOKENS:
        return "ok"
    return "error" if any("error" in e for e in events) else f"broken: {events[-3:]}"


def _held_streams(group: Group, clients: dict[int, httpx.Client], ex) -> dict[int, cf.Future]:
    """Every replica held (no token, no finishing; health checks pass), then one stream through
    each gateway process, until both are in the engines: in flight until ``release``."""
    group.hold(group.replica_pids().values())
    futures = {pid: ex.submit(_stream, c) for pid, c in clients.items()}
    wait_for(lambda: group.running() == len(clients), "a stream from each process in the engines")
    return futures


def test_both_processes_serve_the_same_replicas_and_a_key_limit_holds_across_them(tmp_path):
    with gateway_group(tmp_path, requests_per_minute=1) as group:
        clients = group.pinned_clients()
        (pa, a), (pb, b) = clients.items()
        assert group.replica_pids(a) == group.replica_pids(b)  # the same actors
        # at nice 0, not Ray's default 15 for workers (their output stalled under load)
        assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in group.replica_pids(a).values()} == {0}
        # A minute's budget of 1 request (the next one refills in 60 s, far longer than these
        # three requests take): served on one process, then refused on each, the other first.
        body = {"model": "fake", "prompt": "x"}
        first = a.post("/v1/completions", json=body, headers=_auth())
        assert first.status_code == 200 and first.headers["x-tandem-gateway"] == str(pa), first.text
        for c, pid in ((b, pb), (a, pa)):
            refused = c.post("/v1/completions", json=body, headers=_auth())
            assert refused.status_code == 429 and refused.headers.get("Retry-After"), refused.text
            assert refused.headers["x-tandem-gateway"] == str(pid)
        # The metrics of every process, summed, from either one (a's success, a's and b's refusals).
        for c in (a, b):
            text = c.get("/metrics").text
            assert 'tandem_requests_total{model="fake",route="/v1/completions",status="2xx"} 1.0' in text, text
            assert 'tandem_requests_rejected_total{model="other",reason="rate_limited"} 2.0' in text, text


def test_a_killed_gateway_process_loses_only_its_own_requests(tmp_path):
    with gateway_group(tmp_path) as group, cf.ThreadPoolExecutor(4) as ex:
        clients = group.pinned_clients()
        (victim, _), (survivor, _) = clients.items()
        futures = _held_streams(group, clients, ex)
        before = group.channels()
        assert all(len(c) == 3 for c in before.values()), before  # the parent's and each process's
        os.kill(victim, signal.SIGKILL)
        assert futures[victim].result(60).startswith("broken"), "the killed process's client must see it break"
        group.release()
        assert futures[survivor].result(60) == "ok"  # not lost, whole
        # The survivor keeps serving, and the parent starts another process in the victim's place.
        # (The replacement accepts connections only once its replicas are ready: every answer is 200.)
        seen = set()

        def a_new_process_serves() -> bool:
            r = httpx.post(group.url + "/v1/completions", json={"model": "fake", "prompt": "x"}, headers=_auth(),
                           timeout=60)
            assert r.status_code == 200, r.text
            seen.add(int(r.headers["x-tandem-gateway"]))
            return survivor in seen and bool(seen - {survivor, victim})

        wait_for(a_new_process_serves, "the survivor and a replacement process to serve", timeout=180)
        # The replicas drop the dead process's channel once its lease (renewed by health checks) lapses.
        wait_for(lambda: all(len(before[r] & now) == 2 for r, now in group.channels().items()),
                 "the killed process's channels to be closed on the replicas", timeout=180)


def test_sigterm_drains_every_process(tmp_path):
    metrics_port = free_port()
    with gateway_group(tmp_path, metrics_port=metrics_port) as group, cf.ThreadPoolExecutor(4) as ex:
        clients, probes = group.pinned_clients(), group.pinned_clients()  # a stream's and a probe's connection
        # The one metrics port (the parent's) sums every process's counters.
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).text
        line = f'tandem_requests_total{{model="other",route="/health",status="2xx"}} {float(group.health_requests)}'
        assert line in text, text
        futures = _held_streams(group, clients, ex)
        os.kill(group.proc.pid, signal.SIGTERM)
        for pid, c in probes.items():  # each process: not ready, refuses new requests, keeps its stream
            wait_for(lambda c=c: c.get("/ready").status_code == 503, f"process {pid} to turn not ready")
            refused = c.post("/v1/completions", json={"model": "fake", "prompt": "x"}, headers=_auth())
            assert refused.status_code == 503, refused.text
        group.release()
        assert [f.result(60) for f in futures.values()] == ["ok", "ok"]
        assert group.proc.wait(120) == 0, group.log_tail()


LIGHT, HEAVY, ADMIN = "sk-light-0123456789ab", "sk-heavy-0123456789ab", "sk-admin-0123456789ab"
SHARE_KEYS = [{"key": LIGHT, "name": "light", "weight": 1}, {"key": HEAVY, "name": "heavy", "weight": 3},
              {"key": ADMIN, "name": "ops", "role": "admin"}]


def test_weighted_shares_and_roles_hold_across_both_processes(tmp_path):
    """Tenant light (weight 1) floods through one process only, heavy (weight 3) through the other,
    16 streams each, on one replica of two slots: admission is shared (``gateway/admission/shared.py``),
    so the completions go 3:1, not each process's own slots 1:1. Alone, light takes both slots."""
    fields = {"replicas": 1, "max_in_flight_per_replica": 2}
    with gateway_group(tmp_path, keys=SHARE_KEYS, model_fields=fields) as group:
        (pa, light_conns), (pb, heavy_conns) = group.pinned_pools(16).items()
        for pid, c in ((pa, light_conns[0]), (pb, heavy_conns[0])):  # roles, on each process
            denied = c.get("/admin/usage", headers={"Authorization": f"Bearer {LIGHT}"})
            assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error", denied.text
            assert c.get("/admin/usage", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200, pid

        # Alone, the weight-1 tenant gets the whole replica (both slots, through either process).
        group.hold(group.replica_pids().values())
        with cf.ThreadPoolExecutor(4) as ex:
            held = [ex.submit(_stream, c, LIGHT) for c in (*light_conns[:2], *heavy_conns[:2])]
            wait_for(lambda: group.running() == 2, "the lone tenant's streams to fill both slots")
            group.release()
            assert [f.result(60) for f in held] == ["ok"] * 4

        order: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()
        start = threading.Barrier(32)
        warmup, total = 16, 112

        def flood(name: str, key: str, client: httpx.Client) -> None:
            start.wait(timeout=60)
            while not stop.is_set():
                assert _stream(client, key) == "ok"
                with lock:
                    order.append(name)
                    if len(order) >= total:
                        stop.set()

        with cf.ThreadPoolExecutor(32) as ex:
            futures = [ex.submit(flood, "light", LIGHT, c) for c in light_conns]
            futures += [ex.submit(flood, "heavy", HEAVY, c) for c in heavy_conns]
            for f in futures:
                f.result(300)
        counted = order[warmup:total]
        ratio = counted.count("heavy") / max(1, counted.count("light"))
        assert 2.2 <= ratio <= 3.8, (ratio, counted)
        # Every request counted to its tenant, both processes summed (a stream is counted as its
        # response ends on the server, which may be just after its client read the end).
        expected = {"light": order.count("light") + len(held), "heavy": order.count("heavy")}

        def counted_to_tenants() -> dict:
            usage = light_conns[0].get("/admin/usage", headers={"Authorization": f"Bearer {ADMIN}"}).json()
            return {t: usage["tenants"][t]["fake"]["requests"] for t in ("light", "heavy")}

        wait_for(lambda: counted_to_tenants() == expected, f"the usage to count {expected}", timeout=30)
