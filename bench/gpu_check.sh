#!/usr/bin/env bash
# Re-measure the headline GPU figures on a 4-GPU machine and hold them against bench/headline.json
# (bench/drift.py flags every figure that moved more than 10%). Run it after every change to the step's
# hot path. Each case runs with the host to itself, one after another.
#
# The whole check takes ~15 minutes of GPUs and a device call at most 10, so it is two calls on one warm
# machine (chain them: it is handed back after 30 s idle). Each carries what its part needs (64 MiB a call
# will not hold both): scaling the trainer's wheels with Ray (carry [".gpu"], bash bench/gpu_prepare.sh),
# step TRL and datasets (carry ["runs/carry/deps"], bash bench/carry_model.sh pack):
#   call 1:  bash bench/gpu_check.sh scaling     bench/scaling.py --gpus 1,2,4 --steps 4       (~8.5 min)
#   call 2:  bash bench/gpu_check.sh step        bench/step_vs_trl.py (ours, then TRL) on GPU 0 and
#                                                bench/rollout.py --tune --batches 256 after it  (~6 min)
# Each call prints drift.py's table for what it measured and leaves its results in $OUT (scaling/,
# step_vs_trl/summary.json, rollout.json) for BENCHMARKS.md. The protocol asks for two runs of each:
# repeat the pair, and quote the median and the range.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: gpu_check.sh scaling|step}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
case $part in
  scaling) wheels=.gpu/wheels gsm8k=.gpu/gsm8k marker=/tmp/site/ray ;;
  step) wheels=runs/carry/deps/wheels gsm8k=runs/carry/deps/gsm8k marker=/tmp/site/trl ;;
  *) echo "unknown part $part (scaling or step)" >&2; exit 2 ;;
esac
[ -d "$wheels" ] || { echo "$wheels is missing: carry it (see the header)" >&2; exit 2; }
[ -d $marker ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-gpu-check  # shared by the cases: compiling once is enough
nvidia-smi --query-gpu=index,name --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null || true
case $part in
  scaling)
    python3 bench/scaling.py --gpus 1,2,4 --steps 4 --gsm8k "$gsm8k" --out /tmp/gpu-check-scaling \
      --results "$out/scaling" --budget-s 540 2>&1 | grep -v 'Writing model\|WARNING\|INFO' | tail -20 ;;
  step)
    CUDA_VISIBLE_DEVICES=0 timeout 420 python3 bench/step_vs_trl.py --gsm8k "$gsm8k" --micro-batch 64 \
      --out /tmp/gpu-check-step 2>&1 | grep -v 'Writing model\|WARNING' | tail -12
    mkdir -p "$out/step_vs_trl" && cp /tmp/gpu-check-step/summary.json "$out/step_vs_trl/" 
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/rollout.py --tune --batches 256 --json "$out/rollout.json" \
      2>&1 | tail -3 ;;
esac
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[12]00')
python3 bench/drift.py --results "$out" ${card:+--card "$card"}
