#!/usr/bin/env bash
# A worker pod's command (deploy/kuberay/raycluster.yaml; tests/integration/test_deploy_pods.py
# runs it as it is): a Ray node that joins the head; the gateway's replicas land on such nodes.
# It waits (bounded) for the head's GCS, as KubeRay's wait-gcs-ready init container does, then
# becomes `ray start --block` (exec: SIGTERM reaches it, and it stops the processes it started;
# when one of them dies, it stops the others and exits, and Kubernetes restarts the pod).
#
# Environment (and ray-node.sh's): TANDEM_RAY_HEAD (the head's GCS, host:port; default
# RAY_ADDRESS, which KubeRay sets to the head Service and its port), TANDEM_RAY_WAIT_S (300).
set -euo pipefail

# shellcheck source=deploy/kuberay/ray-node.sh
source "$(dirname "$0")/ray-node.sh"

head=${TANDEM_RAY_HEAD:-${RAY_ADDRESS:-}}
if [[ -z "$head" ]]; then
  log "no head address: set TANDEM_RAY_HEAD=host:port (KubeRay sets RAY_ADDRESS)"
  exit 2
fi
wait_for_gcs "$head" "${TANDEM_RAY_WAIT_S:-300}"
log "ray start --address=${head} ${ray_node_args[*]} --block"
exec ray start "--address=${head}" "${ray_node_args[@]}" --block
