"""The KubeRay pod commands, run here as two "pods" (issue 32, item 5): ``deploy/kuberay/head.sh``
and ``deploy/kuberay/worker.sh``, exactly as the manifests call them, each in a process group of
its own (``tests/integration/pods.py``), configured only through the environment variables the
manifests set. The head starts Ray and `tandem serve` joining it (``ray: {address: auto}``); the
worker joins the head. Both built-in tiny models ask for a custom resource only the worker offers
(``resources.custom``; the head also has no CPU for Ray), so their replicas land on the worker,
which the test checks against Ray's own view of its nodes (the dashboard's state API). Then the
worker pod is killed as a node is lost (SIGKILL to all of it): the gateway stays up (/health 200),
the models' requests get 503 + Retry-After within a bounded client timeout, their replicas wait for
a node (pending); a new worker pod from the same script brings them back, on the new node. Last,
the head pod is stopped as the kubelet stops a container (SIGTERM to its command): its gateway
drains and exits 0, and Ray stops with it. Nothing of any pod outlives the test.

Independent of the session's shared stack: its own ports, Ray temp dirs and Ray cluster."""

import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tandem_core.config import DEFAULT_CONFIG, REPO_ROOT
from tests.integration.pods import Pod
from tests.waiting import wait_for

READY_TIMEOUT_S = float(os.environ.get("TANDEM_TEST_READY_TIMEOUT_S", "600"))
DEPLOY = REPO_ROOT / "deploy" / "kuberay"
LABEL = "tandem-worker"  # the worker pods' custom Ray resource; each replica asks for 1
CLIENT_TIMEOUT_S = 60  # a request that hangs runs into this and fails the test
STOP_TIMEOUT_S = 120  # the head's drain plus Ray's stop

pytestmark = pytest.mark.timeout(int(2 * READY_TIMEOUT_S + 600))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(port: int) -> dict:
    """configs/default.yaml's two tiny models, joining a cluster, each replica needing a worker."""
    default = yaml.safe_load(DEFAULT_CONFIG.read_text())
    models = []
    for model in default["models"]:
        resources = {**model["resources"], "custom": {LABEL: 1}}
        models.append({**model, "resources": resources})
    return {"gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 2},
            "ray": {"address": "auto"}, "models_dir": str(REPO_ROOT / "models"), "models": models}


def _pod_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TANDEM_RAY_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # ray, tandem
    env["TANDEM_RAY_NODE_IP"] = "127.0.0.1"
    env["TANDEM_RAY_OBJECT_STORE_MEMORY"] = str(200 * 1024**2)
    return env


class Cluster:
    """The two pods' settings: what the manifests set, with ports and temp dirs of their own, as
    two pods on one host need (each pod has its own network namespace and /tmp)."""

    def __init__(self, tmp: Path, logs: Path):
        self.tmp = tmp
        self.logs = logs
        self.gcs_port, self.port, self.dashboard_port = _free_port(), _free_port(), _free_port()
        self.config = tmp / "config.yaml"
        self.config.write_text(yaml.safe_dump(_config(self.port)))
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = 0
        self.pods: list[Pod] = []  # every pod started, for the teardown

    def head(self) -> Pod:
        env = {**_pod_env(), "TANDEM_CONFIG": str(self.config), "TANDEM_HOST": "127.0.0.1",
               "TANDEM_PORT": str(self.port), "TANDEM_RAY_PORT": str(self.gcs_port),
               "TANDEM_RAY_TEMP_DIR": str(self.tmp / "h"), "TANDEM_RAY_DASHBOARD_HOST": "127.0.0.1",
               "TANDEM_RAY_DASHBOARD_PORT": str(self.dashboard_port),
               "TANDEM_RAY_METRICS_PORT": str(_free_port()), "TANDEM_RAY_AGENT_PORT": str(_free_port()),
               "TANDEM_RAY_START_ARGS": f"--ray-client-server-port={_free_port()}"}
        self.pods.append(Pod("head", DEPLOY / "head.sh", env, self.logs))
        return self.pods[-1].start()

    def worker(self) -> Pod:
        self.workers += 1
        env = {**_pod_env(), "TANDEM_RAY_HEAD": f"127.0.0.1:{self.gcs_port}",
               "TANDEM_RAY_TEMP_DIR": str(self.tmp / f"w{self.workers}"), "TANDEM_RAY_NUM_CPUS": "2",
               "TANDEM_RAY_RESOURCES": json.dumps({LABEL: 2}),
               "TANDEM_RAY_METRICS_PORT": str(_free_port()), "TANDEM_RAY_AGENT_PORT": str(_free_port())}
        self.pods.append(Pod(f"worker{self.workers}", DEPLOY / "worker.sh", env, self.logs))
        return self.pods[-1].start()

    # -- what the test reads ---------------------------------------------------------------------

    def get(self, path: str, **params) -> httpx.Response:
        return httpx.get(self.url + path, params=params or None, timeout=10)

    def model_ready(self, model: str) -> int | None:
        try:
            return self.get("/ready", model=model).status_code
        except httpx.HTTPError:
            return None  # not listening yet

    def replicas(self) -> dict[str, dict]:
        return {r["model"]: r for r in self.get("/admin/replicas").json()["replicas"]}

    def ray_nodes(self) -> list[dict]:
        """Ray's live nodes as its dashboard's state API lists them."""
        r = httpx.get(f"http://127.0.0.1:{self.dashboard_port}/api/v0/nodes", params={"detail": 1}, timeout=30)
        return [n for n in r.json()["data"]["result"]["result"] if n["state"] == "ALIVE"]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


MODELS = [m["name"] for m in yaml.safe_load(DEFAULT_CONFIG.read_text())["models"]]


@pytest.fixture
def cluster():
    tmp = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))  # short: Ray's socket paths live under it
    c = Cluster(tmp, tmp)
    try:
        yield c
    finally:
        for pod in c.pods:  # whatever is left of them: nothing of either pod may outlive the test
            pod.kill()
        print("\n".join(p.log_tail() for p in c.pods))
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_serving(c: Cluster, pods: list[Pod], what: str) -> float:
    def ready() -> bool:
        for pod in pods:
            if not pod.running:
                pytest.fail(f"pod {pod.name} exited with {pod.proc.returncode} while waiting for {what}:\n"
                            + "\n".join(p.log_tail() for p in pods))
        return all(c.model_ready(m) == 200 for m in MODELS)

    try:
        return wait_for(ready, what, timeout=READY_TIMEOUT_S, interval=1)
    except AssertionError as e:
        pytest.fail(f"{e}\n" + "\n".join(p.log_tail() for p in pods))


def _placed_on(c: Cluster, worker_nodes: set[str]) -> dict[str, str]:
    """Each model's replica runs on a worker node (never the head), at nice 0 (RAY_worker_niceness,
    which the scripts set for `ray start`); model -> node id."""
    rows = c.replicas()
    nodes = {m: rows[m]["node_id"] for m in MODELS}
    assert set(nodes.values()) <= worker_nodes, (nodes, worker_nodes)
    assert all(os.getpriority(os.PRIO_PROCESS, rows[m]["pid"]) == 0 for m in MODELS), rows
    return nodes


def _worker_nodes(c: Cluster) -> tuple[set[str], set[str]]:
    """(head node ids, worker node ids): Ray's live nodes, a worker being one that offers LABEL."""
    nodes = c.ray_nodes()
    head = {n["node_id"] for n in nodes if n["is_head_node"]}
    workers = {n["node_id"] for n in nodes if LABEL in n["resources_total"]}
    assert len(head) == 1 and not head & workers, nodes
    return head, workers


def _chat(c: Cluster, model: str):
    return c.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=4)


def _answers(c: Cluster) -> None:
    for model in MODELS:
        r = _chat(c, model)
        assert r.model == model and r.choices and r.usage.completion_tokens >= 1, r


def test_head_and_worker_pods_serve_and_survive_the_worker(cluster):
    c = cluster
    head = c.head()
    worker = c.worker()  # at once, as KubeRay starts them: the worker waits for the GCS
    took = _wait_serving(c, [head, worker], "both models to be ready on the worker pod")
    print(f"both models ready {took:.0f} s after the pods started")
    head_node, workers = _worker_nodes(c)
    assert len(workers) == 1
    first = _placed_on(c, workers)
    _answers(c)

    # The worker pod is lost, as a node is: SIGKILL to all of it.
    worker.kill()
    assert head.running
    took = wait_for(lambda: all(c.model_ready(m) == 503 for m in MODELS) and c.get("/health").status_code == 200,
                    "both models to be reported down, the gateway up", timeout=READY_TIMEOUT_S, interval=0.5)
    print(f"models down {took:.0f} s after the worker pod was killed")

    def waiting_for_a_node() -> bool:
        """The gateway serves (/health), each model's requests fail fast with 503 + Retry-After
        (a hang would raise APITimeoutError); True once each replica waits for a node."""
        assert c.get("/health").status_code == 200
        for model in MODELS:
            with pytest.raises(openai.APIStatusError) as e:
                _chat(c, model)
            assert e.value.status_code == 503 and e.value.response.headers.get("retry-after"), e.value
        rows = c.replicas()
        return all(rows[m]["state"] == "pending" and LABEL in (rows[m]["error"] or "") for m in MODELS)

    wait_for(waiting_for_a_node, "the replicas to wait for a node offering " + LABEL,
             timeout=READY_TIMEOUT_S, interval=1)
    assert c.get("/ready").status_code == 503  # no model serves: the pod leaves its Service until one does
    assert head.running

    # A new worker pod from the same script: the replicas come back there.
    worker = c.worker()
    took = _wait_serving(c, [head, worker], "both models to be back on the new worker pod")
    print(f"both models back {took:.0f} s after the new worker pod started")
    assert _worker_nodes(c)[0] == head_node
    _, workers_now = _worker_nodes(c)
    second = _placed_on(c, workers_now - workers)
    assert set(second.values()).isdisjoint(first.values())
    _answers(c)

    # The head stopped as the kubelet stops a container: SIGTERM to its command. The gateway drains
    # and exits 0, then Ray stops: nothing of the pod is left. (The worker pod goes in the teardown.)
    assert head.terminate(STOP_TIMEOUT_S) == 0, head.log_tail()
    wait_for(lambda: not head.pids(), "the head pod's processes (Ray) to be gone", timeout=STOP_TIMEOUT_S)
