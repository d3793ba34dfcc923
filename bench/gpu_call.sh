#!/usr/bin/env bash
# The measurements of issues 12, 13 and 15 in ONE device call on a 4-GPU machine, each on its own GPUs:
#   GPUs 0,1  bench/learning.py: SmolLM2-135M on GSM8K, ours and TRL's GRPOTrainer at once, same budget
#   GPU 2     bench/step_vs_trl.py (one GRPO step, Qwen2.5-0.5B shape, ours vs TRL), then bench/rollout.py
#   GPU 3     bench/scaling.py --gpus 1: the step breakdown and actor MFU, torch.compile on and off
# Everything a stage writes lands in $OUT as it goes, so a call cut at its time limit still brings back
# what finished. The machine is offline and a call carries at most 64 MiB, so the inputs come in three
# calls made in quick succession (it stays warm ~30 s between calls):
#   here:    bash bench/carry_model.sh pack && bash bench/gpu_prepare.sh
#   call 1:  carry ["runs/carry/a"]  command: bash bench/carry_model.sh stash
#   call 2:  carry [".gpu"]          command: bash bench/gpu_call.sh stash
#   call 3:  carry ["runs/carry/b", "runs/carry/deps"]  command: BUDGET_S=240 bash bench/gpu_call.sh run
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = stash ]; then
  mkdir -p /tmp/gpu && cp -r .gpu/. /tmp/gpu/ && du -sh /tmp/gpu && exit 0
fi
[ "${1:-}" = run ] || { echo "usage: bash bench/gpu_call.sh stash | run" >&2; exit 2; }

OUT=${OUT:-/tmp/out}
BUDGET_S=${BUDGET_S:-240}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.csv"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/gpu/wheels/*.whl
bash bench/carry_model.sh unpack > "$OUT/unpack.log" 2>&1 || { cat "$OUT/unpack.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
GSM8K=runs/carry/deps/gsm8k

learning() {
  local out=runs/learning
  python3 bench/learning.py prepare --gguf /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf --gsm8k $GSM8K &&
    CUDA_VISIBLE_DEVICES=0 python3 bench/learning.py base &&
    python3 bench/learning.py arms --gpus 0,1 --budget-s "$BUDGET_S" --points 3
  python3 bench/learning.py report
  copy_small runs/learning "$OUT/learning"
}

copy_small() {  # the JSON results and logs of a run folder, not its model folders (base/, weights/)
  mkdir -p "$2" && (cd "$1" 2>/dev/null && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' \) \
    -not -path './base/*' -not -path '*/weights/*' -not -path '*/checkpoints/*' -size -8M \
    -exec cp --parents {} "$2/" \;)
}

step_then_rollout() {
  export CUDA_VISIBLE_DEVICES=2
  python3 bench/step_vs_trl.py --gsm8k $GSM8K --out "$OUT/step_vs_trl"
  python3 bench/rollout.py --tune --json "$OUT/rollout.json"
}

scaling() {
  CUDA_VISIBLE_DEVICES=3 python3 bench/scaling.py --gpus 1 --compile on,off --gsm8k /tmp/gpu/gsm8k \
    --out /tmp/bench --results "$OUT/scaling" --budget-s 480
}

learning > "$OUT/learning.log" 2>&1 &
step_then_rollout > "$OUT/step_rollout.log" 2>&1 &
scaling > "$OUT/scaling.log" 2>&1 &
(while sleep 30; do copy_small runs/learning "$OUT/learning"; done) &
copier=$!
wait -n; wait -n; wait -n
kill $copier
tail -n 25 "$OUT/learning.log" "$OUT/step_rollout.log" "$OUT/scaling.log"
