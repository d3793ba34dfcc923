#!/usr/bin/env bash
# Wait until every named service answers GET /health with 200; fail, naming the laggards, if not.
#
#   wait_for_services.sh [--timeout SECONDS] [--interval SECONDS] NAME=URL[,URL...] ...
#
# A comma-separated list names the replicas of one service; every replica must become healthy.
# Exit 0 when all are healthy, 1 when the deadline passes (one line per service that never
# answered 200, with its last answer), 2 on bad usage. Defaults: SERVICE_WAIT_TIMEOUT_S (600),
# SERVICE_WAIT_INTERVAL_S (2). Needs bash and curl only, so it runs before any Python env exists.
set -uo pipefail

timeout_s=${SERVICE_WAIT_TIMEOUT_S:-600}
interval_s=${SERVICE_WAIT_INTERVAL_S:-2}
names=() urls=()

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) timeout_s=${2:?--timeout needs a value}; shift 2 ;;
    --interval) interval_s=${2:?--interval needs a value}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *=*)
      name=${1%%=*} list=${1#*=}
      if [ -z "$list" ]; then echo "error: service $name has no URL (is its *_URL variable set?)" >&2; exit 2; fi
      IFS=, read -r -a replicas <<<"$list"
      for url in "${replicas[@]}"; do
        [ -n "$url" ] && names+=("$name") && urls+=("${url%/}")
      done
      shift ;;
    *) echo "error: expected NAME=URL[,URL...], got '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [ ${#urls[@]} -eq 0 ]; then echo "error: no service given" >&2; usage >&2; exit 2; fi

# One probe: sets `answer` to a short description of what came back.
probe() {
  local code rc
  code=$(curl -s -o /dev/null -w '%{http_code}' --connect-timeout 2 --max-time 5 "$1/health")
  rc=$?
  case $rc in
    0) answer="HTTP $code" ;;
    6) answer="cannot resolve host" ;;
    7) answer="connection refused" ;;
    28) answer="timed out" ;;
    *) answer="curl exit $rc" ;;
  esac
  [ $rc -eq 0 ] && [ "$code" = 200 ]
}

declare -A last
pending=("${!urls[@]}")
start=$SECONDS
next_report=$((start + 30))
echo "waiting up to ${timeout_s}s for: $(printf '%s ' "${names[@]}" | tr ' ' '\n' | sort -u | paste -sd' ')"
while :; do
  still=()
  for i in "${pending[@]}"; do
    if probe "${urls[$i]}"; then
      echo "healthy: ${names[$i]} ${urls[$i]}"
    else
      last[$i]=$answer
      still+=("$i")
    fi
  done
  pending=("${still[@]}")
  [ ${#pending[@]} -eq 0 ] && { echo "all services healthy after $((SECONDS - start))s"; exit 0; }
  if [ $((SECONDS - start)) -ge "$timeout_s" ]; then
    for i in "${pending[@]}"; do
      echo "error: service ${names[$i]} never became healthy within ${timeout_s}s: ${urls[$i]}/health (last: ${last[$i]})" >&2
    done
    exit 1
  fi
  if [ $SECONDS -ge $next_report ]; then
    for i in "${pending[@]}"; do echo "still waiting for ${names[$i]} ${urls[$i]} (${last[$i]})"; done
    next_report=$((SECONDS + 30))
  fi
  sleep "$interval_s"
done
