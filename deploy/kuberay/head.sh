#!/usr/bin/env bash
# The head pod's command (deploy/kuberay/raycluster.yaml; tests/integration/test_deploy_pods.py
# runs it as it is): Ray's head node, then the gateway joining it.
#   1. `ray start --head --block`, in the background: it watches Ray's processes and, when one
#      dies, stops the others and exits; then this script stops the gateway and exits too, and
#      Kubernetes restarts the pod.
#   2. Wait (bounded) until the GCS answers.
#   3. `tandem serve --config $TANDEM_CONFIG`; the config says `ray: {address: auto}`, which
#      RAY_ADDRESS, set here to this head, resolves.
#   4. SIGTERM (the pod deleted) goes to tandem, which drains its requests
#      (gateway.drain_timeout_s; the pod's terminationGracePeriodSeconds leaves it the time) and
#      exits; then Ray stops (SIGTERM to `ray start --block`, which stops the processes it
#      started). The script exits with tandem's status.
#
# Environment (and ray-node.sh's): TANDEM_CONFIG (/etc/tandem/config.yaml), TANDEM_HOST (0.0.0.0),
# TANDEM_PORT (8000), TANDEM_SERVE_ARGS (more `tandem serve` flags); TANDEM_RAY_PORT (the GCS
# port: KubeRay's RAY_PORT, else 6379), TANDEM_RAY_DASHBOARD_HOST (0.0.0.0),
# TANDEM_RAY_DASHBOARD_PORT (8265), TANDEM_RAY_INCLUDE_DASHBOARD (true), TANDEM_RAY_NO_MONITOR
# (false; true where KubeRay's autoscaler sidecar runs Ray's monitor), TANDEM_RAY_WAIT_S (120).
set -euo pipefail

# No Ray task or replica lands on the head: it runs the gateway (and Ray's GCS and dashboard).
: "${TANDEM_RAY_NUM_CPUS:=0}"
: "${TANDEM_RAY_NUM_GPUS:=0}"
# shellcheck source=deploy/kuberay/ray-node.sh
source "$(dirname "$0")/ray-node.sh"

port=${TANDEM_RAY_PORT:-${RAY_PORT:-6379}}
gcs="${TANDEM_RAY_NODE_IP:-127.0.0.1}:${port}"
args=(--head "--port=${port}"
      "--include-dashboard=${TANDEM_RAY_INCLUDE_DASHBOARD:-true}"
      "--dashboard-host=${TANDEM_RAY_DASHBOARD_HOST:-0.0.0.0}"
      "--dashboard-port=${TANDEM_RAY_DASHBOARD_PORT:-8265}"
      "${ray_node_args[@]}")
if [[ "${TANDEM_RAY_NO_MONITOR:-false}" == true ]]; then
  args+=(--no-monitor)
fi

ray_pid=
tandem_pid=

stop_ray() {
  if kill -0 "$ray_pid" 2>/dev/null; then
    log "stopping Ray"
    kill -TERM "$ray_pid" 2>/dev/null || true
  fi
  wait "$ray_pid" 2>/dev/null || true
}

on_signal() {
  if [[ -n "$tandem_pid" ]]; then
    log "$1: stopping the gateway (it drains its requests), then Ray"
    kill -TERM "$tandem_pid" 2>/dev/null || true
  else
    log "$1 before the gateway started: stopping Ray"
    stop_ray
    exit 143
  fi
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT

log "ray start ${args[*]} --block"
ray start "${args[@]}" --block &
ray_pid=$!
if ! wait_for_gcs "$gcs" "${TANDEM_RAY_WAIT_S:-120}" "$ray_pid"; then
  stop_ray
  exit 1
fi

read -r -a serve_args <<< "${TANDEM_SERVE_ARGS:-}"
config=${TANDEM_CONFIG:-/etc/tandem/config.yaml}
log "Ray is up at ${gcs}: tandem serve --config ${config}"
RAY_ADDRESS="$gcs" tandem serve --config "$config" --host "${TANDEM_HOST:-0.0.0.0}" \
  --port "${TANDEM_PORT:-8000}" "${serve_args[@]}" &
tandem_pid=$!

# Until one of the two exits; a trapped signal interrupts `wait` (no pid then): wait again.
while :; do
  finished=
  status=0
  wait -n -p finished "$ray_pid" "$tandem_pid" || status=$?
  [[ -n "${finished:-}" ]] && break
done

if [[ "$finished" == "$tandem_pid" ]]; then
  log "tandem serve exited (status ${status})"
  stop_ray
  exit "$status"
fi
log "ray start exited (status ${status}): Ray's head processes are gone; stopping the gateway"
kill -TERM "$tandem_pid" 2>/dev/null || true
wait "$tandem_pid" || true
exit 1
