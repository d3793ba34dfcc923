#!/usr/bin/env bash
# GRPO training with `python -m trainer.main_ppo`, configured from environment variables.
#
#   train.sh [key=value ...]      extra verl-style keys, appended last so they win
#
# The variables a launcher sets (SkyPilot envs / --env, compose environment), with their defaults.
# Where SkyPilot's verl examples use another name, both are read (ours first):
#   MODEL_NAME=Qwen/Qwen2.5-0.5B-Instruct  DATASET=gsm8k  TOTAL_EPOCHS=1  TOTAL_STEPS= (empty: epochs decide)
#   TRAIN_BATCH_SIZE=256  VAL_BATCH_SIZE= (empty: the whole validation split)  PPO_MINI_BATCH_SIZE=64
#   ROLLOUT_N=4  ACTOR_LR=1e-6  KL_LOSS_COEF=0.001  MAX_PROMPT_LENGTH=512  MAX_RESPONSE_LENGTH=1024
#   PPO_MICRO_BATCH_SIZE_PER_GPU=8  LOG_PROB_MICRO_BATCH_SIZE_PER_GPU=16 (see the memory note below)
#   ROLLOUT_ENGINE=auto (the built-in engine; hf: transformers, slowest)  GPU_MEMORY_UTILIZATION= (empty:
#     not passed; the share of the GPU the built-in engine's weights and KV cache may take)
#   SAVE_FREQ=20  TEST_FREQ=10
#   PROJECT_NAME or WANDB_PROJECT_NAME=rl-jobgroup  EXPERIMENT_NAME or WANDB_EXPERIMENT_NAME=grpo-$DATASET
#   CHECKPOINT_DIR=checkpoints (checkpoints go to $CHECKPOINT_DIR/$PROJECT_NAME/$EXPERIMENT_NAME and
#     resume from there: trainer.resume_mode=auto)
#   USE_RETRIEVAL=false (a flag: true/false, 1/0, yes/no): true trains with the multi-turn search tool
#     (jobgroup/tools/search_tool_config.yaml, RETRIEVAL_TOPK passages per query) against RETRIEVAL_SERVER_URL,
#     TOOL_FORMAT=search_r1 (Search-R1's tags; hermes: <tool_call> JSON) and MAX_ASSISTANT_TURNS=4
#   USE_CODE_EXECUTOR=false (a flag): true adds the code interpreter (code_interpreter, verl's
#     SandboxFusionTool) on the code-executor at CODE_EXECUTOR_URL: jobgroup/tools/code_tool_config.yaml, or
#     search_code_tool_config.yaml with USE_RETRIEVAL too; TOOL_FORMAT then defaults to hermes (Search-R1's
#     tags call the search tool alone)
#   MAX_TOOL_RESPONSE_LENGTH, TOOL_RESPONSE_TRUNCATE_SIDE (left, right or middle): the tokens of one tool
#     response kept, and which part (unset: the config's 256, middle)
#   VAL_BEFORE_TRAIN=true (a flag): validate once before the first step
#   USE_REMOVE_PADDING=true (a flag): pack each micro-batch without padding (verl's
#     actor_rollout_ref.model.use_remove_padding; varlen flash attention); SHARE_PROMPTS=true (a flag, with
#     packing only): a prompt's ROLLOUT_N samples run the prompt through the layers once, the same
#     gradients (actor_rollout_ref.model.share_prompts, ours; on one H200 the step 0.91x: BENCHMARKS.md)
#   NNODES / GPUS_PER_NODE (default from SKYPILOT_NUM_NODES / SKYPILOT_NUM_GPUS_PER_NODE, else 1)
#   DATA_SERVER_URL, REWARD_SERVER_URL, RETRIEVAL_SERVER_URL, CODE_EXECUTOR_URL: the services
#     (comma-separated replicas; the tool configs read RETRIEVAL_SERVER_URL and CODE_EXECUTOR_URL themselves)
#   SERVICES_AUTH_TOKEN (else CODE_EXECUTOR_AUTH_TOKEN): the bearer token the trainer sends the services
#   WANDB_API_KEY: when set, metrics also go to Weights & Biases
#   DRY_RUN=true prints the command instead of running it.
#
# Memory, for the default model on the 80 GB GPU the job group asks for (H100 or A100-80GB).
# Qwen2.5-0.5B: 0.49 B parameters, 24 layers, hidden 896, 2 KV heads of 64, MLP 4864, vocab 151936.
#   policy, fp32: weights 2 GB + gradients 2 GB + AdamW moments 4 GB          =  8 GB
#   reference (the KL loss), fp32 weights                                      =  2 GB
#   generation, all 256 x 4 = 1024 sequences at once, up to 512 + 1024 tokens, bf16 KV cache
#     24 layers x 2 (K, V) x 2 heads x 64 x 2 bytes = 12 KiB per token -> 1024 x 1536 x 12 KiB
#     = 18 GiB; the built-in engine takes at most gpu_memory_utilization of the card and runs fewer
#     sequences at once if they do not fit; ROLLOUT_ENGINE=hf's cache grows by copies: twice that  <= 36 GB
#   an update micro-batch of 8 x 1536 tokens (gradient checkpointing): saved layer inputs
#     8 x 1536 x 896 x 2 B x 24 = 0.5 GB, one layer's recompute ~0.4 GB, LM-head chunks of 1024
#     tokens x 151936 x 4 B = 0.6 GB and its gradient                         ~  2.5 GB
#   peak ~ 8 + 2 + 36 = 46 GB < 80 GB. Without micro-batches one forward would take the whole
#   per-GPU mini-batch, 64 x 4 = 256 sequences: 32 x the 2.5 GB above, which does not fit.
#   LOG_PROB_MICRO_BATCH_SIZE_PER_GPU=16 runs without gradients (no saved activations): ~1 GB.
# For a larger model, halve the micro-batches (they must divide PPO_MINI_BATCH_SIZE x ROLLOUT_N).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

MODEL_NAME=${MODEL_NAME:-Qwen/Qwen2.5-0.5B-Instruct}
DATASET=${DATASET:-gsm8k}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-1}
TOTAL_STEPS=${TOTAL_STEPS:-}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-256}
VAL_BATCH_SIZE=${VAL_BATCH_SIZE:-}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-64}
PPO_MICRO_BATCH_SIZE_PER_GPU=${PPO_MICRO_BATCH_SIZE_PER_GPU:-8}
LOG_PROB_MICRO_BATCH_SIZE_PER_GPU=${LOG_PROB_MICRO_BATCH_SIZE_PER_GPU:-16}
ROLLOUT_N=${ROLLOUT_N:-4}
ACTOR_LR=${ACTOR_LR:-1e-6}
KL_LOSS_COEF=${KL_LOSS_COEF:-0.001}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-auto}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-}
SAVE_FREQ=${SAVE_FREQ:-20}
TEST_FREQ=${TEST_FREQ:-10}
PROJECT_NAME=${PROJECT_NAME:-${WANDB_PROJECT_NAME:-rl-jobgroup}}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-${WANDB_EXPERIMENT_NAME:-grpo-$DATASET}}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints}
NNODES=${NNODES:-${SKYPILOT_NUM_NODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SKYPILOT_NUM_GPUS_PER_NODE:-1}}

flag() {  # flag NAME: true/false from the environment; a word that is neither stops the script
  local rc=0
  bash "$here/flag.sh" "$1" || rc=$?
  [ $rc -eq 2 ] && exit 2
  return $rc
}
use_retrieval=0
flag USE_RETRIEVAL && use_retrieval=1
use_code_executor=0
flag USE_CODE_EXECUTOR && use_code_executor=1
dry_run=0
flag DRY_RUN && dry_run=1
val_before_train=True
if [ -n "${VAL_BEFORE_TRAIN:-}" ] && ! flag VAL_BEFORE_TRAIN; then val_before_train=False; fi
MAX_ASSISTANT_TURNS=${MAX_ASSISTANT_TURNS:-4}
packed=True shared=True
if [ -n "${USE_REMOVE_PADDING:-}" ] && ! flag USE_REMOVE_PADDING; then packed=False shared=False; fi
if [ -n "${SHARE_PROMPTS:-}" ] && ! flag SHARE_PROMPTS; then shared=False; fi

logger="['console']"
[ -n "${WANDB_API_KEY:-}" ] && logger="['console','wandb']"

args=(
  algorithm.adv_estimator=grpo
  data.source=server
  "data.dataset=$DATASET"
  "data.train_batch_size=$TRAIN_BATCH_SIZE"
  "data.max_prompt_length=$MAX_PROMPT_LENGTH"
  "data.max_response_length=$MAX_RESPONSE_LENGTH"
  "actor_rollout_ref.model.path=$MODEL_NAME"
  "actor_rollout_ref.model.use_remove_padding=$packed"
  "actor_rollout_ref.model.share_prompts=$shared"
  "actor_rollout_ref.actor.optim.lr=$ACTOR_LR"
  "actor_rollout_ref.actor.ppo_mini_batch_size=$PPO_MINI_BATCH_SIZE"
  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$PPO_MICRO_BATCH_SIZE_PER_GPU"
  actor_rollout_ref.actor.use_kl_loss=True
  "actor_rollout_ref.actor.kl_loss_coef=$KL_LOSS_COEF"
  "actor_rollout_ref.rollout.name=$ROLLOUT_ENGINE"
  "actor_rollout_ref.rollout.n=$ROLLOUT_N"
  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$LOG_PROB_MICRO_BATCH_SIZE_PER_GPU"
  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$LOG_PROB_MICRO_BATCH_SIZE_PER_GPU"
  "trainer.logger=$logger"
  "trainer.project_name=$PROJECT_NAME"
  "trainer.experiment_name=$EXPERIMENT_NAME"
  "trainer.nnodes=$NNODES"
  "trainer.n_gpus_per_node=$GPUS_PER_NODE"
  "trainer.total_epochs=$TOTAL_EPOCHS"
  "trainer.save_freq=$SAVE_FREQ"
  "trainer.test_freq=$TEST_FREQ"
  "trainer.val_before_train=$val_before_train"
  "trainer.default_local_dir=$CHECKPOINT_DIR/$PROJECT_NAME/$EXPERIMENT_NAME"
  trainer.resume_mode=auto
)
[ -n "$TOTAL_STEPS" ] && args+=("trainer.total_training_steps=$TOTAL_STEPS")
[ -n "$VAL_BATCH_SIZE" ] && args+=("data.val_batch_size=$VAL_BATCH_SIZE")
[ -n "$GPU_MEMORY_UTILIZATION" ] && args+=("actor_rollout_ref.rollout.gpu_memory_utilization=$GPU_MEMORY_UTILIZATION")
# Quoted: Hydra reads an unquoted a,b as a sweep; the trainer splits the quoted list into replicas.
[ -n "${DATA_SERVER_URL:-}" ] && args+=("services.data_url='$DATA_SERVER_URL'")
[ -n "${REWARD_SERVER_URL:-}" ] && args+=("services.reward_url='$REWARD_SERVER_URL'")
# The bearer token the group's services ask for (the code-executor's own setting, shared by the group's
# tasks, as serve_reward.sh reads it): the trainer sends it (services.auth_token, from the environment so
# that it stays out of the command line this script prints)
if [ -z "${SERVICES_AUTH_TOKEN:-}" ] && [ -n "${CODE_EXECUTOR_AUTH_TOKEN:-}" ]; then
  export SERVICES_AUTH_TOKEN=$CODE_EXECUTOR_AUTH_TOKEN
fi
# The tools: search (USE_RETRIEVAL), the code interpreter (USE_CODE_EXECUTOR) or both. With any, the
# rollouts are multi-turn: each trajectory calls its tools as it generates (trainer/agent/).
tool_config=''
tool_format=$(bash "$here/tool_format.sh") || exit 2  # the data-server's QA prompts follow the same rule
if [ $use_retrieval = 1 ]; then
  if [ -z "${RETRIEVAL_SERVER_URL:-}" ]; then
    echo "error: USE_RETRIEVAL is on but RETRIEVAL_SERVER_URL is not set" >&2
    exit 2
  fi
  # the search tool's endpoint and config (it reads RETRIEVAL_SERVER_URL and RETRIEVAL_TOPK itself)
  args+=("services.retrieval_url='$RETRIEVAL_SERVER_URL'")
  tool_config=jobgroup/tools/search_tool_config.yaml
fi
if [ $use_code_executor = 1 ]; then
  if [ -z "${CODE_EXECUTOR_URL:-}" ]; then
    echo "error: USE_CODE_EXECUTOR is on but CODE_EXECUTOR_URL is not set" >&2
    exit 2
  fi
  # the code tool reads CODE_EXECUTOR_URL itself; Search-R1's tags call the search tool alone: hermes
  tool_config=jobgroup/tools/code_tool_config.yaml
  [ $use_retrieval = 1 ] && tool_config=jobgroup/tools/search_code_tool_config.yaml
fi
if [ -n "$tool_config" ]; then
  args+=(
    actor_rollout_ref.rollout.multi_turn.enable=True
    "actor_rollout_ref.rollout.multi_turn.tool_config_path=$tool_config"
    "actor_rollout_ref.rollout.multi_turn.format=$tool_format"
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=$MAX_ASSISTANT_TURNS"
  )
  [ -n "${MAX_TOOL_RESPONSE_LENGTH:-}" ] &&
    args+=("actor_rollout_ref.rollout.multi_turn.max_tool_response_length=$MAX_TOOL_RESPONSE_LENGTH")
  [ -n "${TOOL_RESPONSE_TRUNCATE_SIDE:-}" ] &&
    args+=("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=$TOOL_RESPONSE_TRUNCATE_SIDE")
fi

cmd=("${PYTHON:-python}" -m trainer.main_ppo "${args[@]}" "$@")
if [ $dry_run = 1 ]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
echo "running: ${cmd[*]}"
exec "${cmd[@]}"
