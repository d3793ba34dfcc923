#!/usr/bin/env bash
# Re-measure the headline GPU figures and hold them against bench/headline.json (bench/drift.py flags
# every figure that moved more than 10%). Run it after every change to the step's hot path. Each case runs
# with the host to itself, one after another. Two parts, a device call each (64 MiB a call will not carry
# what both need):
#   scaling  on a 4-GPU machine, carry [".gpu"] (bash bench/gpu_prepare.sh):
#            bench/scaling.py --gpus 1,2,4 --steps 4                                         (~8 min)
#            (overrides after the part's name go to every case, e.g.
#            actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.model.share_prompts=true;
#            the drift table then compares another configuration with the headline's)
#   step     on a one-GPU machine (the README's figures), carry ["runs/carry/deps"] (bash bench/carry_model.sh
#            pack): bench/step_vs_trl.py (ours, then TRL) and bench/rollout.py --tune --batches 256 (~4 min)
# Each call prints drift.py's table for what it measured and leaves its results in $OUT (scaling/,
# step_vs_trl/summary.json, rollout.json) for BENCHMARKS.md. The protocol asks for at least two runs of
# each: repeat the call, and quote the median and the range.
# Three more parts, each a call on the machine named, carry [".gpu"], with no drift table:
#   tests    one GPU or more: every GPU test (pytest -m gpu) on GPU 0, first after a change to the engine,
#            the update's kernels or the memory phases                                        (~5 min)
#   units    4 GPUs: scaling at 1 GPU, and at 4 with 1 and 2 decoder layers an FSDP unit   (~7 min)
#   tools    4 GPUs: scaling 1/2/4 with Search-R1 tool calls (a BM25 retrieval-server here)  (~9 min)
#   phases   one GPU or more: scaling at 1 GPU with rollout.free_cache_engine true, then false (the KV
#            cache and the decode graphs kept between steps: no capture a phase), step 5 profiled in
#            each, trace_summary.py's table per run, rank 0's trace gzipped into $OUT         (~5 min)
#   share    one GPU or more: the shared-prompt GPU test, then scaling at 1 GPU with
#            actor_rollout_ref.model.share_prompts false, then true (GRPO's 8 samples a prompt)  (~5 min)
#   driver   one GPU or more: scaling at 1 GPU (overrides after the part's name), py-spy sampling the
#            driver at 100 Hz, step 5 profiled: the driver's samples beside rank 0's trace   (~2 min)
#   ab REV   one GPU or more: scaling at 1 GPU in a worktree at commit REV, then in this tree, each
#            alone (scaling.py flags and overrides after REV): a change's before and after   (~5 min)
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: gpu_check.sh scaling|step|tests|units|tools|phases|share|driver|ab}
shift  # the rest: overrides for the scaling and driver parts; REV and overrides for ab
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
case $part in
  scaling|tests|units|tools|phases|share|driver|ab) wheels=.gpu/wheels gsm8k=.gpu/gsm8k marker=ray ;;
  step) wheels=runs/carry/deps/wheels gsm8k=runs/carry/deps/gsm8k marker=trl ;;
  *) echo "unknown part $part (scaling, step, tests, units, tools, phases, share, driver or ab)" >&2; exit 2 ;;
esac
[ -d "$wheels" ] || { echo "$wheels is missing: carry it (see the header)" >&2; exit 2; }
site=/tmp/site-${wheels//\//-}  # one folder a set of wheels: pip --target skips what one already holds
[ -d "$site/$marker" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl || exit 1
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-gpu-check  # shared by the cases: compiling once is enough
nvidia-smi --query-gpu=index,name --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null || true
case $part in
  scaling)
    python3 bench/scaling.py --gpus 1,2,4 --steps 4 --gsm8k "$gsm8k" --out /tmp/gpu-check-scaling \
      --results "$out/scaling" --budget-s 540 "$@" 2>&1 | grep -v 'Writing model\|WARNING\|INFO' | tail -20 ;;
  step)
    CUDA_VISIBLE_DEVICES=0 timeout 420 python3 bench/step_vs_trl.py --gsm8k "$gsm8k" --micro-batch 64 \
      --out /tmp/gpu-check-step 2>&1 | grep -v 'Writing model\|WARNING' | tail -12
    mkdir -p "$out/step_vs_trl" && cp /tmp/gpu-check-step/summary.json "$out/step_vs_trl/" 
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/rollout.py --tune --batches 256 --json "$out/rollout.json" \
      2>&1 | tail -3 ;;
  tests)
    # the modules that hold GPU tests (a whole-tree collection would import what the device lacks)
    files=$(grep -rlE '(pytestmark = |@)pytest\.mark\.gpu' tests --include='test_*.py')
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider $files 2>&1 \
      | tee "$out/gpu_tests.log" | grep -v '^$' | tail -25
    exit "${PIPESTATUS[0]}" ;;
  units)
    python3 bench/scaling.py --gpus 1,4 --layers-per-unit 1,2 --ab-gpus 4 --steps 4 --gsm8k "$gsm8k" \
      --out /tmp/gpu-check-scaling --results "$out/units" --budget-s 540 2>&1 \
      | grep -v 'Writing model\|WARNING\|INFO' | tail -20
    exit 0 ;;
  tools)
    python3 bench/scaling.py --gpus 1,2,4 --tools search --steps 4 --gsm8k "$gsm8k" \
      --out /tmp/gpu-check-scaling --results "$out/tools" --budget-s 540 2>&1 \
      | grep -v 'Writing model\|WARNING\|INFO' | tail -24
    exit 0 ;;
  phases)
    for free in true false; do
      python3 bench/scaling.py --gpus 1 --steps 5 --gsm8k "$gsm8k" --out "/tmp/gpu-check-phases-$free" \
        --results "$out/phases-free-$free" --budget-s 250 "actor_rollout_ref.rollout.free_cache_engine=$free" \
        'trainer.profile_steps=[5]' 2>&1 | grep -E 'metric|timing_s/(gen|update_actor|step)|throughput|status'
      trace=/tmp/gpu-check-phases-$free/0.5b_x1/profile/step_5_policy_rank0.json
      [ -f "$trace" ] && python3 bench/trace_summary.py "$trace" && gzip -c "$trace" > "$out/phases-free-$free/rank0.json.gz"
    done
    exit 0 ;;
  share)
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -m gpu -p no:cacheprovider tests/trainer/test_distributed_units.py \
      -k shared_prompts 2>&1 | tail -3
    for share in false true; do
      python3 bench/scaling.py --gpus 1 --steps 4 --gsm8k "$gsm8k" --out "/tmp/gpu-check-share-$share" \
        --results "$out/share-$share" --budget-s 200 "actor_rollout_ref.model.share_prompts=$share" 2>&1 \
        | grep -E 'metric|timing_s/(gen|ref|update_actor|step)|throughput|mfu|status'
    done
    exit 0 ;;
  driver)
    python3 bench/scaling.py --gpus 1 --steps 5 --sample-driver --gsm8k "$gsm8k" --out /tmp/gpu-check-driver \
      --results "$out/driver" --budget-s 200 'trainer.profile_steps=[5]' "$@" 2>&1 \
      | grep -E 'metric|timing_s/(gen|reward|step)|status'
    trace=/tmp/gpu-check-driver/0.5b_x1/profile/step_5_policy_rank0.json
    [ -f "$trace" ] && python3 bench/trace_summary.py "$trace" && gzip -c "$trace" > "$out/driver/rank0.json.gz"
    exit 0 ;;
  ab)
    rev=${1:?usage: gpu_check.sh ab REV [scaling.py flags and overrides]}
    shift
    root=$PWD before=/tmp/gpu-check-ab-before
    rm -rf "$before" && git worktree prune && git worktree add -q --detach "$before" "$rev" || exit 2
    for arm in before after; do
      tree=$root && [ "$arm" = before ] && tree=$before
      echo "== $arm: $(git -C "$tree" log -1 --format='%h %s')"
      (cd "$tree" && PYTHONPATH="$site:$tree" python3 bench/scaling.py --gpus 1 --steps 4 --gsm8k "$root/$gsm8k" \
        --out "/tmp/gpu-check-ab-$arm" --results "$out/ab-$arm" --budget-s 200 "$@" 2>&1 \
        | grep -E 'metric|timing_s/(gen|ref|update_actor|update_weights|step)|throughput|mfu|status')
    done
    git worktree remove --force "$before"
    exit 0 ;;
esac
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[12]00')
python3 bench/drift.py --results "$out" ${card:+--card "$card"}
