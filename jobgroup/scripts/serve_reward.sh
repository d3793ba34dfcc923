#!/usr/bin/env bash
# Serve the reward-server; with the code-executor on, code rows are scored by running their test cases there.
#
#   serve_reward.sh [extra reward-server flags...]
#
# REWARD_PORT         port to serve on (default 8001)
# USE_CODE_EXECUTOR   a flag (true/false, 1/0, yes/no): true passes --code-executor-url CODE_EXECUTOR_URL,
#                     which enables the `code` scorer; false leaves code rows unscorable (an error per row)
# CODE_EXECUTOR_URL   the code-executor's base URL(s), comma-separated replicas (needed when the flag is on)
# CODE_EXECUTOR_AUTH_TOKEN  the code-executor's bearer token, when it has one (its own setting, shared by the
#                     job group's tasks): handed on as REWARD_SERVER_CODE_EXECUTOR_TOKEN, in the environment
#                     rather than on the command line, where `ps` would show it
# DRY_RUN             a flag: print the command, one word per line, instead of running it
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
port=${REWARD_PORT:-8001}
use_code_executor=$(bash "$here/flag.sh" --print USE_CODE_EXECUTOR)  # stops on a word that is no flag
dry_run=$(bash "$here/flag.sh" --print DRY_RUN)

serve=("$python" -m services.reward_server --port "$port")
if [ "$use_code_executor" = true ]; then
  if [ -z "${CODE_EXECUTOR_URL:-}" ]; then
    echo "error: USE_CODE_EXECUTOR is on but CODE_EXECUTOR_URL is not set" >&2
    exit 2
  fi
  serve+=(--code-executor-url "$CODE_EXECUTOR_URL")
  if [ -n "${CODE_EXECUTOR_AUTH_TOKEN:-}" ]; then
    export REWARD_SERVER_CODE_EXECUTOR_TOKEN="${REWARD_SERVER_CODE_EXECUTOR_TOKEN:-$CODE_EXECUTOR_AUTH_TOKEN}"
  fi
fi
if [ "$dry_run" = true ]; then
  printf '%s\n' "${serve[@]}" "$@"
  exit 0
fi
exec "${serve[@]}" "$@"
