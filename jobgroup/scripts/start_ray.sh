#!/usr/bin/env bash
# Bring up the Ray cluster of a multi-node SkyPilot task: the head on rank 0, every other node joins.
#
#   start_ray.sh [--follow]
#
# rank 0   starts the Ray head unless one already answers at HEAD_IP:RAY_PORT (so `sky exec` on a
#          running cluster reuses it), then waits until all SKYPILOT_NUM_NODES nodes have joined.
# rank > 0 joins the head unless this node already runs a raylet. With --follow it then stays until
#          the head goes away, so a job group's trainer task ends when rank 0 stops Ray.
# Settings: RAY_PORT (6385), RAY_DASHBOARD_PORT (8280), RAY_WAIT_S (600: how long to wait for the
# head / for the workers), RAY_NUM_CPUS (empty: Ray counts the node's cores; a CPU-only group sets it to
# its ranks per node, so that each node's placement group lands on its own node, as GPUs force).
# Node loss: the GCS (on the head) declares a node dead after RAY_health_check_failure_threshold missed
# health checks, one every RAY_health_check_period_ms, each given RAY_health_check_timeout_ms. Ray's
# defaults (5 x 3 s, 10 s timeouts) take up to a minute for a node that vanished without closing its
# connections (a preempted VM, a killed container); the defaults below bound it at about
# 5 x (2 s + 2 s) = 20 s, after which the trainer's calls on that node's ranks fail and name the node. The ports are those of SkyPilot's verl examples: clear of Ray's defaults and
# of the Ray cluster SkyPilot runs on every node for itself (6380, dashboard 8266). SkyPilot sets SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES and
# SKYPILOT_NUM_GPUS_PER_NODE.
set -euo pipefail

follow=0
[ "${1:-}" = "--follow" ] && follow=1
port=${RAY_PORT:-6385}
dashboard_port=${RAY_DASHBOARD_PORT:-8280}
wait_s=${RAY_WAIT_S:-600}
rank=${SKYPILOT_NODE_RANK:-0}
num_nodes=${SKYPILOT_NUM_NODES:-1}
gpus=${SKYPILOT_NUM_GPUS_PER_NODE:-0}
head_ip=$(printf '%s\n' "${SKYPILOT_NODE_IPS:-127.0.0.1}" | head -n1)
address="$head_ip:$port"
cpus=()
[ -n "${RAY_NUM_CPUS:-}" ] && cpus=(--num-cpus="$RAY_NUM_CPUS")
export RAY_health_check_period_ms=${RAY_health_check_period_ms:-2000}
export RAY_health_check_timeout_ms=${RAY_health_check_timeout_ms:-2000}
export RAY_health_check_failure_threshold=${RAY_health_check_failure_threshold:-5}

# A TCP probe first: `ray status` takes ~40 s to give up on an address where nothing listens.
head_alive() {
  timeout 3 bash -c ">/dev/tcp/$head_ip/$port" 2>/dev/null || return 1
  ray status --address "$address" >/dev/null 2>&1
}

alive_nodes() {
  python - "$address" <<'PY'
import sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(1 for node in ray.nodes() if node["Alive"]))
PY
}

if [ "$rank" = 0 ]; then
  if head_alive; then
    echo "Ray head already running at $address: reusing it"
  else
    echo "starting Ray head at $address (dashboard :$dashboard_port)"
    ray start --head --node-ip-address="$head_ip" --port="$port" --num-gpus="$gpus" "${cpus[@]}" \
      --dashboard-host=0.0.0.0 --dashboard-port="$dashboard_port" --disable-usage-stats
  fi
  deadline=$((SECONDS + wait_s))
  while [ "$num_nodes" -gt 1 ]; do
    joined=$(alive_nodes 2>/dev/null || echo 0)
    [ "$joined" -ge "$num_nodes" ] && { echo "Ray cluster ready: $joined/$num_nodes nodes"; break; }
    if [ $SECONDS -ge $deadline ]; then
      echo "error: only $joined of $num_nodes nodes joined the Ray head at $address within ${wait_s}s" >&2
      exit 1
    fi
    sleep 5
  done
else
  if pgrep -x raylet >/dev/null 2>&1; then
    echo "node $rank already runs a raylet: not joining again"
  else
    deadline=$((SECONDS + wait_s))
    until head_alive; do
      if [ $SECONDS -ge $deadline ]; then
        echo "error: no Ray head answered at $address within ${wait_s}s" >&2
        exit 1
      fi
      sleep 5
    done
    echo "node $rank joining the Ray head at $address"
    ray start --address="$address" --num-gpus="$gpus" "${cpus[@]}" --disable-usage-stats
  fi
  if [ $follow = 1 ]; then
    while head_alive; do sleep 30; done
    echo "Ray head at $address is gone: node $rank leaves"
    ray stop --force >/dev/null 2>&1 || true
  fi
fi
