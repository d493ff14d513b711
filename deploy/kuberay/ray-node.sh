# Sourced by head.sh and worker.sh: the `ray start` flags both pods share, from environment
# variables (each optional; the manifests set them, tests/integration/test_deploy_pods.py sets
# them to run two "pods" on one host).
#
#   TANDEM_RAY_NUM_CPUS, TANDEM_RAY_NUM_GPUS   --num-cpus, --num-gpus (unset: Ray detects them;
#                                              the head defaults both to 0: no replica on it)
#   TANDEM_RAY_MEMORY                          --memory (bytes)
#   TANDEM_RAY_OBJECT_STORE_MEMORY             --object-store-memory (bytes)
#   TANDEM_RAY_RESOURCES                       --resources, a JSON object of custom resources
#   TANDEM_RAY_NODE_IP                         --node-ip-address (unset: Ray picks the pod's IP)
#   TANDEM_RAY_TEMP_DIR                        --temp-dir (unset: /tmp/ray)
#   TANDEM_RAY_METRICS_PORT                    --metrics-export-port (8080: KubeRay's `metrics` port)
#   TANDEM_RAY_AGENT_PORT                      --dashboard-agent-listen-port (52365: the port
#                                              KubeRay's injected worker probes ask)
#   TANDEM_RAY_START_ARGS                      more `ray start` flags, split on whitespace
#
# Ray reads RAY_<name> variables as its own settings, so ours carry a TANDEM_ prefix; the two of
# KubeRay's we read (RAY_PORT, RAY_ADDRESS) mean there what they mean here.

# Replicas run at nice 0 (Ray starts its workers at 15; vLLM's output stalled behind the gateway,
# DEVELOPERS.md): the raylet reads this when `ray start` starts it.
export RAY_worker_niceness="${RAY_worker_niceness:-0}"

# Ray's token authentication: on with a token (RAY_AUTH_TOKEN, e.g. from a Secret on every pod),
# else off. Said explicitly because every Ray command here (ray start, ray health-check, tandem's
# ray.init) must agree, and left unset `ray start --head` turns it on when ~/.ray/auth_token
# happens to exist while the other commands do not.
if [[ -n "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ]]; then
  export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
else
  export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
fi

# Ray opens a socket per worker and per connection; KubeRay's generated command raises the limit
# the same way, and with ray.io/overwrite-container-cmd that is ours to do. A hard limit below
# 65536 (an unprivileged user) caps it there.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# ray_node_args: the shared flags, as an array.
ray_node_args=()
_flag() { if [[ -n "$2" ]]; then ray_node_args+=("--$1=$2"); fi; }
_flag num-cpus "${TANDEM_RAY_NUM_CPUS:-}"
_flag num-gpus "${TANDEM_RAY_NUM_GPUS:-}"
_flag memory "${TANDEM_RAY_MEMORY:-}"
_flag object-store-memory "${TANDEM_RAY_OBJECT_STORE_MEMORY:-}"
_flag resources "${TANDEM_RAY_RESOURCES:-}"
_flag node-ip-address "${TANDEM_RAY_NODE_IP:-}"
_flag temp-dir "${TANDEM_RAY_TEMP_DIR:-}"
_flag metrics-export-port "${TANDEM_RAY_METRICS_PORT:-8080}"
_flag dashboard-agent-listen-port "${TANDEM_RAY_AGENT_PORT:-52365}"
ray_node_args+=("--disable-usage-stats")
read -r -a _extra <<< "${TANDEM_RAY_START_ARGS:-}"
ray_node_args+=("${_extra[@]}")
unset _extra
unset -f _flag

log() { echo "[$(date -u +%H:%M:%S)] $(basename "$0"): $*" >&2; }

# wait_for_gcs ADDRESS SECONDS [PID]: until the GCS at ADDRESS answers `ray health-check` (as
# KubeRay's wait-gcs-ready init container asks it); fails after SECONDS, or at once if PID (the
# `ray start` that should bring it up) has exited.
wait_for_gcs() {
  local address=$1 deadline=$((SECONDS + $2)) pid=${3:-}
  until ray health-check --address "$address" >/dev/null 2>&1; do
    if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
      log "ray start exited before the GCS at $address answered"
      return 1
    fi
    if ((SECONDS >= deadline)); then
      log "the GCS at $address did not answer within $2 s"
      return 1
    fi
    sleep 1  # a poll interval
  done
}
