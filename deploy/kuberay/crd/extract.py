"""Derive the field tree the manifest test checks against (``raycluster-v1.json`` here) from a
KubeRay CRD file, e.g. ray-project/kuberay's
``ray-operator/config/crd/bases/ray.io_rayclusters.yaml`` fetched to /tmp:

    python deploy/kuberay/crd/extract.py /tmp/ray.io_rayclusters.yaml --version v1 \\
        --commit SHA --kuberay "1.x" > deploy/kuberay/crd/raycluster-v1.json

What it keeps of the version's openAPIV3Schema: property names, types (``int-or-string`` for
Kubernetes quantities and ports), ``items``, ``additionalProperties``, ``required`` and ``enum``;
no descriptions, formats, patterns or defaults. The Kubernetes objects KubeRay embeds are not
copied: a pod template becomes ``{"$ref": "io.k8s.api.core.v1.PodTemplateSpec"}`` and the head's
Service ``{"$ref": "io.k8s.api.core.v1.Service"}`` (the test checks pod templates against core/v1
field names of its own), and ``status`` is left out (a manifest never sets it).
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

EMBEDDED = {
    ("spec", "headGroupSpec", "template"): "io.k8s.api.core.v1.PodTemplateSpec",
    ("spec", "workerGroupSpecs", "[]", "template"): "io.k8s.api.core.v1.PodTemplateSpec",
    ("spec", "headGroupSpec", "headService"): "io.k8s.api.core.v1.Service",
}
DROPPED = {("status",)}


def reduce(schema: dict, path: tuple[str, ...] = ()) -> dict:
    """``schema`` (one openAPIV3Schema node) reduced to names, types and required lists."""
    if path in EMBEDDED:
        return {"$ref": EMBEDDED[path]}
    if schema.get("x-kubernetes-int-or-string"):
        return {"type": "int-or-string"}
    node: dict = {"type": schema.get("type", "object")}
    if "enum" in schema:
        node["enum"] = list(schema["enum"])
    if "properties" in schema:
        node["properties"] = {name: reduce(sub, (*path, name)) for name, sub in sorted(schema["properties"].items())
                              if (*path, name) not in DROPPED}
    if isinstance(schema.get("additionalProperties"), dict):
        node["additionalProperties"] = reduce(schema["additionalProperties"], (*path, "{}"))
    if "items" in schema:
        node["items"] = reduce(schema["items"], (*path, "[]"))
    if schema.get("required"):
        node["required"] = sorted(schema["required"])
    return node


def extract(crd: dict, version: str) -> dict:
    """The reduced schema of ``version`` of ``crd`` (a CustomResourceDefinition)."""
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return reduce(v["schema"]["openAPIV3Schema"])
    raise SystemExit(f"no version {version!r} in {crd['metadata']['name']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("crd", help="the CRD's YAML file")
    p.add_argument("--version", default="v1")
    p.add_argument("--repo", default="ray-project/kuberay")
    p.add_argument("--path", default="ray-operator/config/crd/bases/ray.io_rayclusters.yaml")
    p.add_argument("--commit", required=True)
    p.add_argument("--kuberay", required=True, help="the KubeRay release the commit belongs to")
    args = p.parse_args(argv)
    with open(args.crd) as f:
        crd = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "CustomResourceDefinition")
    out = {"_source": {"repo": args.repo, "path": args.path, "commit": args.commit, "kuberay": args.kuberay,
                       "crd": crd["metadata"]["name"], "version": args.version,
                       "derived_by": "deploy/kuberay/crd/extract.py"},
           "kind": crd["spec"]["names"]["kind"],
           "schema": extract(crd, args.version)}
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
