"""deploy/: the KubeRay manifests, the pod scripts and the Dockerfile, checked without a cluster.

- Every manifest parses, and every field a RayCluster uses is one KubeRay's CRD defines, with its
  type and its required fields: the CRD's tree (``deploy/kuberay/crd/raycluster-v1.json``, derived
  from ray-project/kuberay's CRD, its source in the file) down to the pod templates, and from
  there a list of core/v1 field names kept here (CORE_V1: the Kubernetes API's PodTemplateSpec,
  PodSpec, Container and what they hold, as far as a pod template here may use them; a field
  outside it fails the test as unknown, so add it here when a manifest needs it). ConfigMaps and
  Services are checked against CORE_V1 too.
- The containers' commands are the scripts in deploy/kuberay, as the image holds them; the
  scripts parse (`bash -n`); what a script passes to `ray start` is what rayStartParams (which
  KubeRay's autoscaler reads) say.
- The head's probes, the model cache and HF_TOKEN; the ConfigMap's config loads in tandem.
- The Dockerfile: a pinned CUDA base, constraints/gpu.txt, a non-root user, no built-in models,
  every COPY source present.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gateway.config import parse_config

REPO = Path(__file__).resolve().parents[2]
KUBERAY = REPO / "deploy" / "kuberay"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
CRD_TREE = KUBERAY / "crd" / "raycluster-v1.json"
APP_DIR = "/opt/tandem"  # where the Dockerfile puts the repository's files (WORKDIR)

# core/v1 (Kubernetes API reference), by type: a field is "string", "integer", "boolean",
# "int-or-string", "map" (string to string), "quantities" (string to int-or-string), "object" (any
# content, not checked further), a type's name, or [a type] for a list.
CORE_V1: dict[str, dict] = {
    "ObjectMeta": {"name": "string", "namespace": "string", "generateName": "string", "labels": "map",
                   "annotations": "map"},
    "PodTemplateSpec": {"metadata": "ObjectMeta", "spec": "PodSpec"},
    "PodSpec": {"containers": ["Container"], "initContainers": ["Container"], "volumes": ["Volume"],
                "nodeSelector": "map", "affinity": "object", "tolerations": ["object"],
                "serviceAccountName": "string", "securityContext": "PodSecurityContext",
                "terminationGracePeriodSeconds": "integer", "restartPolicy": "string",
                "imagePullSecrets": [{"name": "string"}], "priorityClassName": "string", "runtimeClassName": "string",
                "schedulerName": "string", "enableServiceLinks": "boolean", "shareProcessNamespace": "boolean",
                "dnsPolicy": "string", "hostIPC": "boolean"},
    "PodSecurityContext": {"runAsUser": "integer", "runAsGroup": "integer", "runAsNonRoot": "boolean",
                           "fsGroup": "integer", "fsGroupChangePolicy": "string", "supplementalGroups": ["integer"],
                           "seccompProfile": {"type": "string", "localhostProfile": "string"}},
    "Container": {"name": "string", "image": "string", "imagePullPolicy": "string", "command": ["string"],
                  "args": ["string"], "workingDir": "string", "env": ["EnvVar"], "envFrom": ["object"],
                  "ports": ["ContainerPort"], "resources": "ResourceRequirements", "volumeMounts": ["VolumeMount"],
                  "readinessProbe": "Probe", "livenessProbe": "Probe", "startupProbe": "Probe",
                  "lifecycle": "object", "securityContext": "SecurityContext",
                  "terminationMessagePolicy": "string"},
    "EnvVar": {"name": "string", "value": "string", "valueFrom": "EnvVarSource"},
    "EnvVarSource": {"secretKeyRef": "KeySelector", "configMapKeyRef": "KeySelector",
                     "fieldRef": {"apiVersion": "string", "fieldPath": "string"},
                     "resourceFieldRef": {"containerName": "string", "resource": "string", "divisor": "int-or-string"}},
    "KeySelector": {"name": "string", "key": "string", "optional": "boolean"},
    "ContainerPort": {"name": "string", "containerPort": "integer", "protocol": "string", "hostPort": "integer",
                      "hostIP": "string"},
    "ResourceRequirements": {"limits": "quantities", "requests": "quantities"},
    "VolumeMount": {"name": "string", "mountPath": "string", "readOnly": "boolean", "subPath": "string",
                    "subPathExpr": "string", "mountPropagation": "string"},
    "Probe": {"httpGet": {"path": "string", "port": "int-or-string", "host": "string", "scheme": "string",
                          "httpHeaders": [{"name": "string", "value": "string"}]},
              "exec": {"command": ["string"]}, "tcpSocket": {"port": "int-or-string", "host": "string"},
              "initialDelaySeconds": "integer", "periodSeconds": "integer", "timeoutSeconds": "integer",
              "successThreshold": "integer", "failureThreshold": "integer",
              "terminationGracePeriodSeconds": "integer"},
    "SecurityContext": {"runAsUser": "integer", "runAsGroup": "integer", "runAsNonRoot": "boolean",
                        "allowPrivilegeEscalation": "boolean", "readOnlyRootFilesystem": "boolean",
                        "privileged": "boolean", "capabilities": {"add": ["string"], "drop": ["string"]},
                        "seccompProfile": {"type": "string", "localhostProfile": "string"}},
    "Volume": {"name": "string", "configMap": {"name": "string", "items": ["object"], "defaultMode": "integer",
                                               "optional": "boolean"},
               "secret": {"secretName": "string", "items": ["object"], "defaultMode": "integer", "optional": "boolean"},
               "emptyDir": {"medium": "string", "sizeLimit": "int-or-string"},
               "persistentVolumeClaim": {"claimName": "string", "readOnly": "boolean"},
               "hostPath": {"path": "string", "type": "string"}},
    # The other kinds the manifests hold.
    "ConfigMap": {"apiVersion": "string", "kind": "string", "metadata": "ObjectMeta", "data": "map",
                  "binaryData": "map", "immutable": "boolean"},
    "Service": {"apiVersion": "string", "kind": "string", "metadata": "ObjectMeta", "spec": "ServiceSpec"},
    "ServiceSpec": {"selector": "map", "ports": ["ServicePort"], "type": "string", "clusterIP": "string",
                    "publishNotReadyAddresses": "boolean", "sessionAffinity": "string",
                    "externalTrafficPolicy": "string", "internalTrafficPolicy": "string"},
    "ServicePort": {"name": "string", "port": "integer", "targetPort": "int-or-string", "protocol": "string",
                    "nodePort": "integer", "appProtocol": "string"},
    "PersistentVolumeClaim": {"apiVersion": "string", "kind": "string", "metadata": "ObjectMeta",
                              "spec": "PersistentVolumeClaimSpec"},
    "PersistentVolumeClaimSpec": {"accessModes": ["string"], "storageClassName": "string",
                                  "resources": {"requests": "quantities", "limits": "quantities"},
                                  "volumeMode": "string", "volumeName": "string"},
}
REQUIRED = {"Container": ["name"], "EnvVar": ["name"], "KeySelector": ["key"], "VolumeMount": ["mountPath", "name"],
            "Volume": ["name"], "ContainerPort": ["containerPort"], "ServicePort": ["port"], "PodSpec": ["containers"]}


def core(spec) -> dict:
    """A CORE_V1 entry as a node of the CRD tree's form."""
    if isinstance(spec, list):
        return {"type": "array", "items": core(spec[0])}
    if isinstance(spec, dict):
        return {"type": "object", "properties": {k: core(v) for k, v in spec.items()}}
    if spec == "map":
        return {"type": "object", "additionalProperties": {"type": "string"}}
    if spec == "quantities":
        return {"type": "object", "additionalProperties": {"type": "int-or-string"}}
    if spec in ("string", "integer", "boolean", "int-or-string", "object"):
        return {"type": spec}
    node = core(CORE_V1[spec])
    if spec in REQUIRED:
        node["required"] = REQUIRED[spec]
    return node


REFS = {"io.k8s.api.core.v1.PodTemplateSpec": "PodTemplateSpec", "io.k8s.api.core.v1.Service": "Service"}
TYPES = {"string": str, "integer": int, "boolean": bool, "int-or-string": (int, str), "object": dict, "array": list}


def problems(value, node: dict, path: str) -> Iterator[str]:
    """What in ``value`` the schema ``node`` does not define: unknown fields, wrong types, missing
    required fields and values outside an enum, each with its path."""
    if "$ref" in node:
        node = core(REFS[node["$ref"]])
    kind = node["type"]
    if not isinstance(value, TYPES[kind]) or (kind == "integer" and isinstance(value, bool)):
        yield f"{path}: a {kind} expected, got {type(value).__name__} {value!r}"
        return
    if "enum" in node and value not in node["enum"]:
        yield f"{path}: {value!r} is none of {node['enum']}"
    if kind == "array":
        for i, item in enumerate(value):
            yield from problems(item, node["items"], f"{path}[{i}]")
    if kind != "object" or ("properties" not in node and "additionalProperties" not in node):
        return  # a scalar, or an object whose content the schema leaves free
    for name in node.get("required", []):
        if name not in value:
            yield f"{path}.{name}: required, missing"
    for name, sub in value.items():
        field = node.get("properties", {}).get(name, node.get("additionalProperties"))
        if field is None:
            yield f"{path}.{name}: not a field of the schema"
        else:
            yield from problems(sub, field, f"{path}.{name}")


def raycluster_schema() -> dict:
    tree = json.loads(CRD_TREE.read_text())
    schema = json.loads(json.dumps(tree["schema"]))
    # The CRD leaves metadata to the API server (ObjectMeta): checked against core/v1's names.
    schema["properties"]["metadata"] = core("ObjectMeta")
    return schema


def manifests() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(KUBERAY.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
            if doc is not None]


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def the_raycluster() -> dict:
    (cluster,) = of_kind("RayCluster")
    return cluster


def containers(cluster: dict) -> dict[str, dict]:
    """Group name ("head" or a worker group's) -> its Ray container (the first)."""
    groups = {"head": cluster["spec"]["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]})
    return {name: g["template"]["spec"]["containers"][0] for name, g in groups.items()}


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# -- the manifests ----------------------------------------------------------------------------------


def test_every_manifest_parses_and_names_itself():
    docs = manifests()
    assert {path.name for path, _ in docs} >= {"raycluster.yaml"}
    for path, doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys() and doc["metadata"].get("name"), (path, doc)


def test_the_crd_tree_names_its_source():
    source = json.loads(CRD_TREE.read_text())["_source"]
    assert source["repo"] == "ray-project/kuberay" and source["path"].endswith("ray.io_rayclusters.yaml")
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]) and source["kuberay"] and source["version"] == "v1"


def test_every_raycluster_field_is_one_the_kuberay_crd_defines():
    schema = raycluster_schema()
    for cluster in of_kind("RayCluster"):
        assert cluster["apiVersion"] == "ray.io/v1"  # the version the tree is of
        found = list(problems(cluster, schema, cluster["metadata"]["name"]))
        assert not found, f"first: {found[0]}\nall:\n" + "\n".join(found)


@pytest.mark.parametrize("kind", ["ConfigMap", "Service", "PersistentVolumeClaim"])
def test_core_objects_use_core_v1_fields(kind):
    for doc in of_kind(kind):
        found = list(problems(doc, core(kind), doc["metadata"]["name"]))
        assert not found, found


@pytest.mark.parametrize(("where", "bad"), [
    (("spec", "headGroupSpec"), "rayStartParam"),
    (("spec", "workerGroupSpecs", 0), "idleTimeout"),
    (("spec", "headGroupSpec", "template", "spec", "containers", 0), "readinesProbe"),
    (("spec", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "env", 1, "valueFrom", "secretKeyRef"),
     "optinal"),
])
def test_the_check_finds_an_unknown_field(where, bad):
    """The walk is not vacuous: a misspelt field anywhere, the pod template included, is named."""
    cluster = json.loads(json.dumps(the_raycluster()))
    node = cluster
    for step in where:
        node = node[step]
    node[bad] = "x"
    found = list(problems(cluster, raycluster_schema(), "tandem"))
    assert found and found[0].endswith(f".{bad}: not a field of the schema"), found


def test_a_wrong_type_and_a_missing_required_field_are_found():
    cluster = json.loads(json.dumps(the_raycluster()))
    cluster["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "8"
    del cluster["spec"]["workerGroupSpecs"][0]["groupName"]
    found = list(problems(cluster, raycluster_schema(), "tandem"))
    assert any("maxReplicas: a integer expected" in p for p in found), found
    assert any(p.endswith("groupName: required, missing") for p in found), found


# -- the pods' commands -------------------------------------------------------------------------------


def test_scripts_parse():
    scripts = sorted(KUBERAY.glob("*.sh"))
    assert {s.name for s in scripts} >= {"head.sh", "worker.sh", "ray-node.sh"}
    for script in scripts:
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, (script, r.stderr)


def test_containers_run_the_scripts_the_image_holds():
    """Each Ray container's command is one of deploy/kuberay's scripts, at the path the Dockerfile
    copies it to; KubeRay runs it as it is (ray.io/overwrite-container-cmd)."""
    cluster = the_raycluster()
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    dockerfile = DOCKERFILE.read_text()
    assert re.search(rf"^WORKDIR {APP_DIR}$", dockerfile, re.M)
    copied = " ".join(line for line in dockerfile.splitlines() if line.startswith("COPY "))
    commands = {group: c["command"] for group, c in containers(cluster).items()}
    assert commands["head"] == [f"{APP_DIR}/deploy/kuberay/head.sh"], commands
    for group, command in commands.items():
        assert len(command) == 1 and "args" not in containers(cluster)[group], command
        script = REPO / Path(command[0]).relative_to(APP_DIR)
        assert script.is_file() and script.stat().st_mode & 0o111, script
        assert str(script.relative_to(REPO)) in copied, f"the Dockerfile does not copy {script}"
        for sourced in re.findall(r'source "\$\(dirname "\$0"\)/([\w.-]+)"', script.read_text()):
            assert f"deploy/kuberay/{sourced}" in copied, sourced
    assert any(c["command"] == [f"{APP_DIR}/deploy/kuberay/worker.sh"] for c in containers(cluster).values())


RAY_START = {"num-cpus": "TANDEM_RAY_NUM_CPUS", "num-gpus": "TANDEM_RAY_NUM_GPUS", "memory": "TANDEM_RAY_MEMORY",
             "resources": "TANDEM_RAY_RESOURCES", "object-store-memory": "TANDEM_RAY_OBJECT_STORE_MEMORY"}


def script_defaults(script: Path) -> dict[str, str]:
    """The ``: "${NAME:=value}"`` defaults a script sets."""
    return dict(re.findall(r'^: "\$\{(\w+):=([^}]*)\}"', script.read_text(), re.M))


def test_ray_start_params_say_what_the_scripts_pass():
    """The autoscaler plans a group's pods from rayStartParams; the scripts pass their own flags
    from the environment: the two must agree on each resource either names."""
    cluster = the_raycluster()
    groups = {"head": cluster["spec"]["headGroupSpec"]} | {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for name, group in groups.items():
        container = containers(cluster)[name]
        script = REPO / Path(container["command"][0]).relative_to(APP_DIR)
        env = {k: e.get("value") for k, e in env_of(container).items()}
        passed = {param: env.get(var) or script_defaults(script).get(var) for param, var in RAY_START.items()}
        stated = {param: group["rayStartParams"].get(param) for param in RAY_START}
        assert passed == stated, (name, passed, stated)


def test_replicas_run_at_nice_zero():
    text = (KUBERAY / "ray-node.sh").read_text()
    assert 'export RAY_worker_niceness="${RAY_worker_niceness:-0}"' in text


# -- probes, secrets, cache, config ---------------------------------------------------------------


def test_head_probes_readiness_on_ready_and_liveness_on_health():
    head = containers(the_raycluster())["head"]
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8000}
    assert head["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert {"containerPort": 8000, "name": "openai"} in head["ports"]
    service = next(s for s in of_kind("Service") if s["metadata"]["name"] == "tandem")
    assert service["spec"]["selector"] == {"ray.io/cluster": the_raycluster()["metadata"]["name"],
                                           "ray.io/node-type": "head"}
    assert service["spec"]["ports"][0]["targetPort"] == 8000


def test_workers_take_hf_token_from_a_secret_and_cache_models_on_a_volume():
    cluster = the_raycluster()
    for group in cluster["spec"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        env = env_of(container)
        ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["optional"] is True and ref["name"] and ref["key"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = mounts[env["HF_HOME"]["value"]]
        assert volume in {v["name"] for v in group["template"]["spec"]["volumes"]}


def test_the_configmap_config_loads_and_joins_the_cluster():
    (configmap,) = of_kind("ConfigMap")
    head = containers(the_raycluster())["head"]
    config_path = Path(env_of(head)["TANDEM_CONFIG"]["value"])
    mounted = {m["mountPath"]: m["name"] for m in head["volumeMounts"]}
    assert mounted[str(config_path.parent)] == "tandem-config" == configmap["metadata"]["name"]
    cfg = parse_config(yaml.safe_load(configmap["data"][config_path.name]), Path("configmap/config.yaml"))
    assert cfg.ray.address == "auto" and cfg.models


# -- listeners and durable state (issue 50) ---------------------------------------------------------


def _script_port(text: str, var: str, default_re: str) -> tuple[str, int]:
    m = re.search(default_re, text)
    assert m, (var, default_re)
    return var, int(m.group(1))


def pod_listeners(group: str, container: dict, config: dict) -> list[tuple[str, int]]:
    """(listener, port) of every fixed port a pod's processes bind, as its scripts, its environment
    (the container's env, else the scripts' defaults) and tandem's config say: Ray's GCS, dashboard,
    client server, metrics and dashboard agent; tandem's gateway and metrics listener (head)."""
    node, head = (KUBERAY / "ray-node.sh").read_text(), (KUBERAY / "head.sh").read_text()
    env = {k: e.get("value") for k, e in env_of(container).items()}

    def port(var: str, text: str, pattern: str) -> int:
        return int(env[var]) if env.get(var) else _script_port(text, var, pattern)[1]

    out = [("ray metrics", port("TANDEM_RAY_METRICS_PORT", node, r'TANDEM_RAY_METRICS_PORT:-(\d+)')),
           ("ray dashboard agent", port("TANDEM_RAY_AGENT_PORT", node, r'TANDEM_RAY_AGENT_PORT:-(\d+)'))]
    if group == "head":
        extra = env.get("TANDEM_RAY_START_ARGS") or ""
        client = re.search(r"--ray-client-server-port[= ](\d+)", extra)
        out += [("ray gcs", port("TANDEM_RAY_PORT", head, r'RAY_PORT:-(\d+)')),
                ("ray dashboard", port("TANDEM_RAY_DASHBOARD_PORT", head, r'TANDEM_RAY_DASHBOARD_PORT:-(\d+)')),
                ("ray client server", int(client.group(1)) if client else 10001),  # `ray start --head`'s default
                ("tandem gateway", port("TANDEM_PORT", head, r'TANDEM_PORT:-(\d+)'))]  # --port wins over the config
        if (config.get("metrics") or {}).get("port") is not None:
            out.append(("tandem metrics", config["metrics"]["port"]))
    return out


def _clashes(listeners: list[tuple[str, int]]) -> list[str]:
    by_port: dict[int, list[str]] = {}
    for name, number in listeners:
        by_port.setdefault(number, []).append(name)
    return [f"{number}: {' and '.join(names)}" for number, names in sorted(by_port.items()) if len(names) > 1]


def _configmap_config() -> dict:
    (configmap,) = of_kind("ConfigMap")
    return yaml.safe_load(configmap["data"]["config.yaml"])


def test_no_two_listeners_of_one_pod_share_a_port():
    """The head pod ran Ray's metrics and tandem's on 8080 both (issue 50): one of them could not
    bind. Every fixed listener of each pod has a port of its own, and each port a container
    declares is one of them."""
    config = _configmap_config()
    for group, container in containers(the_raycluster()).items():
        listeners = pod_listeners(group, container, config)
        assert not _clashes(listeners), (group, _clashes(listeners))
        declared = {p["containerPort"] for p in container.get("ports", [])}
        assert declared <= {number for _, number in listeners}, (group, declared, listeners)


def test_the_clash_check_finds_a_planted_clash():
    config = {**_configmap_config(), "metrics": {"host": "0.0.0.0", "port": 8080}}  # the shipped bug
    head = containers(the_raycluster())["head"]
    assert _clashes(pod_listeners("head", head, config)) == ["8080: ray metrics and tandem metrics"]


def test_the_batch_store_lives_on_the_head_pods_volume():
    """batches.data_dir is a mount of a PersistentVolumeClaim in the head pod; the image names
    the same folder as its state volume and as the default's base (XDG_STATE_HOME)."""
    data_dir = _configmap_config()["batches"]["data_dir"]
    cluster = the_raycluster()
    head_spec = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in containers(cluster)["head"]["volumeMounts"]}
    volume = next(v for v in head_spec["volumes"] if v["name"] == mounts[data_dir])
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim in {c["metadata"]["name"] for c in of_kind("PersistentVolumeClaim")}
    steps = instructions(DOCKERFILE.read_text())
    assert ("VOLUME", data_dir) in steps
    env = " ".join(args for op, args in steps if op == "ENV")
    assert re.search(r"XDG_STATE_HOME=(\S+)", env).group(1) + "/tandem" == data_dir


# -- the image ------------------------------------------------------------------------------------


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continuation lines joined, comments dropped."""
    lines = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def test_dockerfile_base_is_cuda_and_pinned():
    froms = [args for op, args in instructions(DOCKERFILE.read_text()) if op == "FROM"]
    assert froms, "no FROM"
    for image in froms:
        name, _, tag = image.split()[0].partition(":")
        assert tag and tag != "latest" and "$" not in image, image
    assert froms[-1].startswith("nvidia/cuda:"), froms


def test_dockerfile_installs_with_the_gpu_constraints_as_a_non_root_user():
    ops = instructions(DOCKERFILE.read_text())
    runs = " ".join(args for op, args in ops if op == "RUN")
    assert "pip install -c constraints/gpu.txt '.[gpu]'" in runs
    assert "python3.11" in runs
    users = [args for op, args in ops if op == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith(("root:", "0:")), users
    env = " ".join(args for op, args in ops if op == "ENV")
    assert "HF_HOME=" in env


def test_dockerfile_copies_what_exists_and_no_models():
    for op, args in instructions(DOCKERFILE.read_text()):
        if op != "COPY":
            continue
        *sources, _dest = [a for a in args.split() if not a.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"
            assert not source.startswith("models"), "the built-in models are not baked in"


# -- the CRD tree's extraction ----------------------------------------------------------------------


def test_extract_keeps_names_types_and_required_only():
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract", KUBERAY / "crd" / "extract.py")
    extract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extract)
    crd = {"metadata": {"name": "rayclusters.ray.io"}, "spec": {"versions": [{"name": "v1", "schema": {
        "openAPIV3Schema": {"type": "object", "properties": {
            "status": {"type": "object", "properties": {"state": {"type": "string"}}},
            "spec": {"type": "object", "description": "words", "required": ["headGroupSpec"], "properties": {
                "headGroupSpec": {"type": "object", "properties": {
                    "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
                    "template": {"type": "object", "properties": {"spec": {"type": "object"}}}}},
                "workerGroupSpecs": {"type": "array", "items": {"type": "object", "properties": {
                    "maxReplicas": {"type": "integer", "format": "int32", "default": 2147483647},
                    "template": {"type": "object"}}}},
                "autoscalerOptions": {"type": "object", "properties": {
                    "upscalingMode": {"type": "string", "enum": ["Default", "Aggressive"]},
                    "resources": {"type": "object", "properties": {"limits": {
                        "type": "object", "additionalProperties": {
                            "anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": "^x$",
                            "x-kubernetes-int-or-string": True}}}}}}}}}}}}]}}
    pod = {"$ref": "io.k8s.api.core.v1.PodTemplateSpec"}
    assert extract.extract(crd, "v1") == {"type": "object", "properties": {"spec": {
        "type": "object", "required": ["headGroupSpec"], "properties": {
            "autoscalerOptions": {"type": "object", "properties": {
                "resources": {"type": "object", "properties": {"limits": {
                    "type": "object", "additionalProperties": {"type": "int-or-string"}}}},
                "upscalingMode": {"type": "string", "enum": ["Default", "Aggressive"]}}},
            "headGroupSpec": {"type": "object", "properties": {
                "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
                "template": pod}},
            "workerGroupSpecs": {"type": "array", "items": {"type": "object", "properties": {
                "maxReplicas": {"type": "integer"}, "template": pod}}}}}}}


def test_prometheus_operator_objects_scrape_the_metrics_port_and_carry_the_alert_rules():
    (config,) = of_kind("ConfigMap")
    metrics = yaml.safe_load(config["data"]["config.yaml"])["metrics"]
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    port = next(p for p in services["tandem-metrics"]["spec"]["ports"] if p["name"] == "tandem-metrics")
    assert port["targetPort"] == metrics["port"] == 8001 and metrics["host"] == "0.0.0.0"
    head = containers(the_raycluster())["head"]
    assert {"containerPort": 8001, "name": "tandem-metrics"} in head["ports"]
    (monitor,) = of_kind("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= services["tandem-metrics"]["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["tandem-metrics"]
    (rule,) = of_kind("PrometheusRule")
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "tandem-alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]  # one set of rules, two ways to load it


def test_the_collector_config_wires_its_pipeline():
    cfg = yaml.safe_load((REPO / "deploy" / "otel" / "collector.yaml").read_text())
    pipe = cfg["service"]["pipelines"]["traces"]
    for part in ("receivers", "processors", "exporters"):
        assert set(pipe[part]) <= set(cfg[part]), part
    assert set(cfg["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
