#!/usr/bin/env bash
# GRPO training with `python -m trainer.main_ppo`, configured from environment variables.
#
#   train.sh [key=value ...]      extra verl-style keys, appended last so they win
#
# The variables a launcher sets (SkyPilot envs / --env, compose environment), with their defaults:
#   MODEL_NAME=Qwen/Qwen2.5-0.5B-Instruct  DATASET=gsm8k  TOTAL_EPOCHS=1  TOTAL_STEPS= (empty: epochs decide)
#   TRAIN_BATCH_SIZE=256  PPO_MINI_BATCH_SIZE=64  ROLLOUT_N=4  ACTOR_LR=1e-6  KL_LOSS_COEF=0.001
#   MAX_PROMPT_LENGTH=512  MAX_RESPONSE_LENGTH=1024  ROLLOUT_ENGINE=sglang  GPU_MEMORY_UTILIZATION=0.5
#   SAVE_FREQ=20  TEST_FREQ=10  PROJECT_NAME=rl-jobgroup  EXPERIMENT_NAME=grpo-$DATASET
#   CHECKPOINT_DIR=checkpoints (checkpoints go to $CHECKPOINT_DIR/$PROJECT_NAME/$EXPERIMENT_NAME and
#     resume from there: trainer.resume_mode=auto)
#   USE_RETRIEVAL=0 (1: hand RETRIEVAL_SERVER_URL to the trainer for the search tool)
#   NNODES / GPUS_PER_NODE (default from SKYPILOT_NUM_NODES / SKYPILOT_NUM_GPUS_PER_NODE, else 1)
#   DATA_SERVER_URL, REWARD_SERVER_URL, RETRIEVAL_SERVER_URL: the services (comma-separated replicas)
#   WANDB_API_KEY: when set, metrics also go to Weights & Biases
#   DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

MODEL_NAME=${MODEL_NAME:-Qwen/Qwen2.5-0.5B-Instruct}
DATASET=${DATASET:-gsm8k}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-1}
TOTAL_STEPS=${TOTAL_STEPS:-}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-256}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-64}
ROLLOUT_N=${ROLLOUT_N:-4}
ACTOR_LR=${ACTOR_LR:-1e-6}
KL_LOSS_COEF=${KL_LOSS_COEF:-0.001}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-sglang}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.5}
SAVE_FREQ=${SAVE_FREQ:-20}
TEST_FREQ=${TEST_FREQ:-10}
PROJECT_NAME=${PROJECT_NAME:-rl-jobgroup}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-grpo-$DATASET}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints}
USE_RETRIEVAL=${USE_RETRIEVAL:-0}
NNODES=${NNODES:-${SKYPILOT_NUM_NODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SKYPILOT_NUM_GPUS_PER_NODE:-1}}

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
  "actor_rollout_ref.actor.optim.lr=$ACTOR_LR"
  "actor_rollout_ref.actor.ppo_mini_batch_size=$PPO_MINI_BATCH_SIZE"
  actor_rollout_ref.actor.use_kl_loss=True
  "actor_rollout_ref.actor.kl_loss_coef=$KL_LOSS_COEF"
  "actor_rollout_ref.rollout.name=$ROLLOUT_ENGINE"
  "actor_rollout_ref.rollout.n=$ROLLOUT_N"
  "actor_rollout_ref.rollout.gpu_memory_utilization=$GPU_MEMORY_UTILIZATION"
  "trainer.logger=$logger"
  "trainer.project_name=$PROJECT_NAME"
  "trainer.experiment_name=$EXPERIMENT_NAME"
  "trainer.nnodes=$NNODES"
  "trainer.n_gpus_per_node=$GPUS_PER_NODE"
  "trainer.total_epochs=$TOTAL_EPOCHS"
  "trainer.save_freq=$SAVE_FREQ"
  "trainer.test_freq=$TEST_FREQ"
  "trainer.default_local_dir=$CHECKPOINT_DIR/$PROJECT_NAME/$EXPERIMENT_NAME"
  trainer.resume_mode=auto
)
[ -n "$TOTAL_STEPS" ] && args+=("trainer.total_training_steps=$TOTAL_STEPS")
# Quoted: Hydra reads an unquoted a,b as a sweep; the trainer splits the quoted list into replicas.
[ -n "${DATA_SERVER_URL:-}" ] && args+=("services.data_url='$DATA_SERVER_URL'")
[ -n "${REWARD_SERVER_URL:-}" ] && args+=("services.reward_url='$REWARD_SERVER_URL'")
if [ "$USE_RETRIEVAL" = 1 ]; then
  if [ -z "${RETRIEVAL_SERVER_URL:-}" ]; then
    echo "error: USE_RETRIEVAL=1 but RETRIEVAL_SERVER_URL is not set" >&2
    exit 2
  fi
  # The search tool's endpoint. Multi-turn tool rollouts themselves are switched on with the extra key
  # actor_rollout_ref.rollout.multi_turn.enable=True once the trainer supports them.
  args+=("services.retrieval_url='$RETRIEVAL_SERVER_URL'")
fi

cmd=("${PYTHON:-python}" -m trainer.main_ppo "${args[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
echo "running: ${cmd[*]}"
exec "${cmd[@]}"
