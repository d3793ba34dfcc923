#!/usr/bin/env bash
# The GPU measurements of issues 13 and 14 on ONE 4-GPU machine, each stage on its own GPUs (the learning
# runs have their own detached start / wait now: bench/learning.py's docstring):
#   GPU 2     bench/search_r1.py (tool calls on vs off), then bench/step_vs_trl.py (ours vs TRL, one step)
#   GPU 3     bench/actor_mfu.py (where the actor update's MFU goes), then bench/rollout.py
# The machine is offline and a call carries at most 64 MiB, so the inputs come in calls made in quick
# succession (it stays warm ~30 s between calls); the stages outlive a call, so the budget may exceed
# one call's 10 minutes:
#   here:    bash bench/carry_model.sh pack && bash bench/carry_model.sh pack-search
#   call 1:  carry ["runs/carry/a", "runs/carry/search"]   command: bash bench/gpu_call.sh stash
#   (call 1b, only when call 1 says scipy is missing: carry ["runs/carry/scipy"], same command)
#   call 2:  carry ["runs/carry/b", "runs/carry/deps"]     command: bash bench/gpu_call.sh start
#   then:    bash bench/gpu_call.sh wait 540   (each call brings back what has finished so far, in $OUT)
# `run` instead of `start` runs the stages in the foreground of one call.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=/tmp/results
GSM8K=runs/carry/deps/gsm8k

copy_small() {  # the JSON results and logs of a run folder, not its model folders (base/, weights/)
  mkdir -p "$2" && (cd "$1" 2>/dev/null && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' \
    -o -name '*.md' \) -not -path './base/*' -not -path '*/weights/*' -not -path '*/checkpoints/*' \
    -not -path '*/model/*' -size -8M -exec cp --parents {} "$2/" \;)
}

stash() {  # keep what this call carried in /tmp, which outlives the call while the machine stays warm
  mkdir -p /tmp/stash /tmp/wheels
  [ -f runs/carry/a/model.part0 ] && cp runs/carry/a/model.part0 /tmp/stash/
  for d in runs/carry/search runs/carry/scipy; do [ -d "$d" ] && cp "$d"/* /tmp/wheels/; done
  ls /tmp/stash /tmp/wheels | head -40
  python3 -c "import scipy; print('scipy', scipy.__version__)" 2>&1 | tail -1
  nvidia-smi --query-gpu=index,name,memory.total --format=csv
}

setup() {
  mkdir -p "$RESULTS"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$RESULTS/gpus.csv"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheels/*.whl
  bash bench/carry_model.sh unpack > "$RESULTS/unpack.log" 2>&1 || { cat "$RESULTS/unpack.log"; exit 1; }
  mkdir -p runs/carry/wiki && cp /tmp/wheels/*.jsonl runs/carry/wiki/
}

search_then_step() {
  export CUDA_VISIBLE_DEVICES=2
  python3 bench/search_r1.py --qa runs/carry/wiki/hotpot_dev100_qa.jsonl \
    --corpus runs/carry/wiki/hotpot_dev100_corpus.jsonl --out /tmp/search_r1
  copy_small /tmp/search_r1 "$RESULTS/search_r1"
  python3 bench/step_vs_trl.py --gsm8k $GSM8K --out "$RESULTS/step_vs_trl"
}

search_only() {  # a re-run of the search stage alone, on GPU ${SEARCH_GPU:-3}
  export CUDA_VISIBLE_DEVICES=${SEARCH_GPU:-3}
  local out=${SEARCH_OUT:-/tmp/search_r1}
  rm -rf "$out/tools" "$out/no-tools"
  # shellcheck disable=SC2086
  python3 bench/search_r1.py --qa runs/carry/wiki/hotpot_dev100_qa.jsonl \
    --corpus runs/carry/wiki/hotpot_dev100_corpus.jsonl --out "$out" ${SEARCH_ARGS:-}
  copy_small "$out" "$RESULTS/$(basename "$out")"
}

mfu_then_rollout() {
  export CUDA_VISIBLE_DEVICES=3
  python3 bench/actor_mfu.py --json "$RESULTS/actor_mfu.json"
  python3 bench/rollout.py --tune --json "$RESULTS/rollout.json"
}

stages() {
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  search_then_step > "$RESULTS/search_step.log" 2>&1 &
  mfu_then_rollout > "$RESULTS/mfu_rollout.log" 2>&1 &
  (while sleep 30; do copy_small /tmp/search_r1 "$RESULTS/search_r1"; done) &
  local copier=$!
  wait -n; wait -n
  kill $copier
  date > "$RESULTS/DONE"
}

wait_for() {  # up to $1 s, or until every stage has finished; then bring back the results so far
  local deadline=$((SECONDS + ${1:-540}))
  while [ ! -f "$RESULTS/DONE" ] && [ $SECONDS -lt $deadline ]; do sleep 10; done
  rm -rf /tmp/pack && copy_small "$RESULTS" /tmp/pack && mkdir -p "${OUT:-/tmp/out}" &&
    tar czf "${OUT:-/tmp/out}/results.tgz" -C /tmp/pack .  # one file: a call brings back few files
  [ -f "$RESULTS/DONE" ] && echo "all stages done" || echo "still running"
  tail -n 8 "$RESULTS"/*.log | cut -c1-400
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv
}

case "${1:-}" in
  stash) stash ;;
  run) setup && stages && wait_for 0 ;;
  start) setup && { setsid nohup bash "$0" stages-bg > /tmp/stages.log 2>&1 < /dev/null & } && sleep 20 && wait_for 0 ;;
  stages-bg) stages ;;
  search-bg) export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; search_only > "$RESULTS/${SEARCH_LOG:-search}.log" 2>&1 ;;
  wait) wait_for "${2:-540}" ;;
  *) echo "usage: bash bench/gpu_call.sh stash | run | start | wait [SECONDS]" >&2; exit 2 ;;
esac
