"""The KubeRay pod commands, run here as two "pods" (issue 32, item 5; issue 50: as written):
``deploy/kuberay/head.sh`` and ``deploy/kuberay/worker.sh``, exactly as the manifest calls them,
each in a process group, a network namespace and a ``/tmp/ray`` of its own (``tests/integration/
pods.py``: a pod's own IP and ports), configured with the manifest's own environment and the
ConfigMap's config verbatim, ports included (the gateway on 8000, its metrics on 8001, Ray's GCS,
dashboard, client server, metrics and agent on theirs). Rewritten, and only these: the model (the
built-in tiny ones of configs/default.yaml), the addresses (KubeRay's RAY_ADDRESS for the worker:
the head's here), the volumes' paths (the config's mount, the model cache, the state claim: folders
of the test), and the object store's size (the manifest leaves it to the container's memory limit,
which this host has no cgroup for).

The head starts Ray and `tandem serve` joining it (``ray: {address: auto}``); the worker joins the
head. The head offers Ray no CPU, so the replicas land on the worker, which the test checks
against Ray's own view of its nodes (the dashboard's state API). Both metrics listeners of the head
answer. Then the worker pod is killed as a node is lost (SIGKILL to all of it): the gateway stays
up (/health 200), the models' requests get 503 + Retry-After within a bounded client timeout,
their replicas wait for a node (pending); a new worker pod from the same script brings them back,
on the new node. Then a batch runs and the head pod is killed outright (the worker pod with it, as
Kubernetes restarts a worker whose head went away): a new head pod on the same state volume, and a
new worker, complete the batch with every line once. Last, the head pod is stopped as the kubelet
stops a container (SIGTERM to its command): its gateway drains and exits 0, and Ray stops with it.
Nothing of any pod outlives the test.

Independent of the session's shared stack: its own namespaces, ports, Ray cluster and data."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tandem_core.config import DEFAULT_CONFIG, REPO_ROOT
from tests.batches import answered, chat_lines, completed, submit
from tests.integration.pods import Network, Pod
from tests.waiting import wait_for

READY_TIMEOUT_S = float(os.environ.get("TANDEM_TEST_READY_TIMEOUT_S", "600"))
DEPLOY = REPO_ROOT / "deploy" / "kuberay"
CLIENT_TIMEOUT_S = 60  # a request that hangs runs into this and fails the test
STOP_TIMEOUT_S = 120  # the head's drain plus Ray's stop
OBJECT_STORE = str(200 * 1024**2)
BATCH_LINES = 60

# alone under -n (tests/parallel.py): two pods' Ray and vLLM at once, a pod lost
pytestmark = [pytest.mark.alone, pytest.mark.timeout(int(3 * READY_TIMEOUT_S + 900)),
              pytest.mark.skipif(os.geteuid() != 0, reason="pods in network namespaces need root (CI runs as root)")]


def _manifest() -> tuple[dict, dict]:
    """(the RayCluster, the ConfigMap's config) of deploy/kuberay/raycluster.yaml."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "raycluster.yaml").read_text()) if d]
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    return cluster, yaml.safe_load(configmap["data"]["config.yaml"])


def _container(cluster: dict, group: str) -> dict:
    spec = cluster["spec"]["headGroupSpec"] if group == "head" else cluster["spec"]["workerGroupSpecs"][0]
    return spec["template"]["spec"]["containers"][0]


def _env(container: dict) -> dict[str, str]:
    """The container's env as the manifest sets it (a Secret the cluster lacks, optional: unset)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _mount(container: dict, volume: str) -> str:
    return next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume)


class Cluster:
    """The two pods, as the manifest makes them (module docstring: what is rewritten)."""

    def __init__(self, tmp: Path, net: Network):
        self.tmp, self.net = tmp, net
        self.manifest, config = _manifest()
        head = _container(self.manifest, "head")
        self.state = tmp / "state"  # the claim mounted at batches.data_dir
        default = yaml.safe_load(DEFAULT_CONFIG.read_text())
        config = {**config, "models": default["models"],
                  "batches": {**config["batches"], "data_dir": str(self.state)}}
        assert config["batches"]["data_dir"] and _mount(head, "tandem-state") == _manifest()[1]["batches"]["data_dir"]
        config_dir = tmp / "etc"  # the ConfigMap's mount
        config_dir.mkdir()
        self.config_path = config_dir / Path(_env(head)["TANDEM_CONFIG"]).name
        self.config_path.write_text(yaml.safe_dump(config))
        self.config = config
        self.head_ns, self.head_ip = net.add("head")
        self.url = f"http://{self.head_ip}:{config['gateway']['port']}"
        self.workers = 0
        self.pods: list[Pod] = []  # every pod started, for the teardown

    def _base(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TANDEM_"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the image's venv
        return {**env, "TANDEM_RAY_OBJECT_STORE_MEMORY": OBJECT_STORE}

    def head(self) -> Pod:
        env = {**self._base(), **_env(_container(self.manifest, "head")), "TANDEM_CONFIG": str(self.config_path)}
        self.pods.append(Pod(f"head{len(self.pods)}", DEPLOY / "head.sh", env, self.tmp, self.head_ns))
        return self.pods[-1].start()

    def worker(self) -> Pod:
        self.workers += 1
        container = _container(self.manifest, "worker")
        env = {**self._base(), **_env(container), "RAY_ADDRESS": f"{self.head_ip}:6379",  # KubeRay's, to the head
               "HF_HOME": str(self.tmp / "cache")}
        ns, _ = self.net.add(f"worker{self.workers}")
        self.pods.append(Pod(f"worker{self.workers}", DEPLOY / "worker.sh", env, self.tmp, ns))
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
        """Ray's live nodes as its dashboard's state API lists them (the manifest's dashboard port)."""
        r = httpx.get(f"http://{self.head_ip}:8265/api/v0/nodes", params={"detail": 1}, timeout=30)
        return [n for n in r.json()["data"]["result"]["result"] if n["state"] == "ALIVE"]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


MODELS = [m["name"] for m in yaml.safe_load(DEFAULT_CONFIG.read_text())["models"]]


@pytest.fixture
def cluster():
    tmp = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))  # short: Ray's socket paths live under it
    net = Network()
    c = None
    try:
        c = Cluster(tmp, net)
        yield c
    finally:
        for pod in c.pods if c is not None else []:  # whatever is left of them: nothing may outlive the test
            pod.kill()
        if c is not None:
            print("\n".join(p.log_tail() for p in c.pods))
        net.close()
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
    """(head node ids, worker node ids): Ray's live nodes; the head offers no CPU (the manifest's)."""
    nodes = c.ray_nodes()
    head = {n["node_id"] for n in nodes if n["is_head_node"]}
    workers = {n["node_id"] for n in nodes if not n["is_head_node"]}
    assert len(head) == 1 and not any(n["resources_total"].get("CPU") for n in nodes if n["is_head_node"]), nodes
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
    # The head pod's two metrics listeners, each on its manifest port (they clashed on 8080 before).
    ray_metrics = httpx.get(f"http://{c.head_ip}:8080/metrics", timeout=30)
    ours = httpx.get(f"http://{c.head_ip}:{c.config['metrics']['port']}/metrics", timeout=30)
    assert ray_metrics.status_code == 200 and ours.status_code == 200 and "tandem_requests_total" in ours.text
    assert "tandem_requests_total" not in ray_metrics.text

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
        return all(rows[m]["state"] == "pending" for m in MODELS)

    wait_for(waiting_for_a_node, "the replicas to wait for a node", timeout=READY_TIMEOUT_S, interval=1)
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

    # A batch runs; the head pod is killed outright, and the worker pod with it (Kubernetes restarts
    # a worker whose head went away: its Ray node dies with the GCS). A new head pod on the same
    # state volume, and a new worker, finish the batch: every line once.
    client = c.client()
    batch_id = submit(client, chat_lines(BATCH_LINES, MODELS[0], max_tokens=48, temperature=0, ignore_eos=True))
    done = answered(client, batch_id, 8)
    head.kill()
    worker.kill()
    assert done < BATCH_LINES, "the batch finished before the head was killed: nothing was tested"
    head, worker = c.head(), c.worker()
    took = _wait_serving(c, [head, worker], "both models back behind a new head pod")
    print(f"a new head pod served {took:.0f} s after it started")
    completed(c.client(), batch_id, BATCH_LINES)

    # The head stopped as the kubelet stops a container: SIGTERM to its command. The gateway drains
    # and exits 0, then Ray stops: nothing of the pod is left. (The worker pod goes in the teardown.)
    assert head.terminate(STOP_TIMEOUT_S) == 0, head.log_tail()
    wait_for(lambda: not head.pids(), "the head pod's processes (Ray) to be gone", timeout=STOP_TIMEOUT_S)
