"""The schema's run-level sections (trainer.*, services.*) and the whole `Config`.

Split from trainer/config/schema.py only to keep files short; together they are the one typed schema.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, field_validator

from trainer.config.schema import (
    SECRET_KEYS,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    CriticConfig,
    CustomRewardFunction,
    DataConfig,
    Logger,
    RewardModelConfig,
    Section,
    _one_or_many,
)


class TrainerConfig(Section):
    project_name: str = Field("verl_examples", description="Project name (tracking, checkpoint folder).")
    experiment_name: str = Field("gsm8k", description="Run name (tracking, checkpoint folder).")
    logger: list[Logger] = Field(
        default_factory=lambda: ["console"],
        description="Metric sinks: console, jsonl, tensorboard, wandb, swanlab.",
    )
    log_val_generations: int = Field(
        0, ge=0, description="Validation samples (prompt, response, score) logged each time."
    )
    nnodes: int = Field(1, ge=1, description="Machines (Ray nodes); more than one trains through Ray.")
    n_gpus_per_node: int = Field(
        1, ge=1, description="GPUs per machine; more than one GPU in all runs its ranks as Ray actors."
    )
    use_ray: bool | None = Field(
        None,
        description="Run the role groups' ranks as Ray actors (one per GPU). null: when nnodes x "
        "n_gpus_per_node > 1; false: one rank in this process (CPU debugging, the offline demo, one GPU). "
        "Either way the ranks are the same (FSDP2, colocated engines).",
    )
    role_pools: Literal["colocated", "separate"] = Field(
        "colocated",
        description="Ray runs: colocated shares every GPU, and one process on it, between policy, rollout, "
        "reference and critic; separate gives each role its own nnodes x n_gpus_per_node GPUs.",
    )
    balance_batch: bool = Field(
        True, description="Ray runs: deal rows to ranks balanced by tokens (false: in consecutive runs)."
    )
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto: cuda when available, else cpu.")
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="Forward/backward precision (weights and optimizer stay fp32). auto: bf16 autocast on "
        "CUDA, fp32 on CPU. bf16 on a CPU with AMX / AVX512-BF16 is ~3x faster; on a CPU without them "
        "torch's bf16 matmuls are ~70x slower, so bf16 there runs fp32 (said at start).",
    )
    seed: int = Field(
        1, description="Seed of python, numpy and torch RNGs (and of data order unless data.seed)."
    )
    total_epochs: int = Field(30, ge=1, description="Passes over the training prompts.")
    total_training_steps: int | None = Field(
        None, ge=1, description="Stop after this many steps (wins over epochs)."
    )
    save_freq: int = Field(
        -1, ge=-1, description="Checkpoint every N steps (and at the end); -1 or 0: never."
    )
    test_freq: int = Field(-1, ge=-1, description="Validate every N steps (and at the end); -1 or 0: never.")
    val_before_train: bool = Field(True, description="Validate once before the first step.")
    val_only: bool = Field(False, description="Validate and exit without training.")
    critic_warmup: int = Field(
        0, ge=0, description="Steps that train only the critic before the actor starts."
    )
    default_local_dir: str = Field(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        description="Checkpoint root folder.",
    )
    log_dir: str = Field(
        "runs/${trainer.project_name}/${trainer.experiment_name}",
        description="Run folder: JSONL metrics, TensorBoard events, generations, report PNGs.",
    )
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        "auto",
        description="auto: resume from the latest checkpoint if any; resume_path: from resume_from_path.",
    )
    resume_from_path: str | None = Field(
        None, description="A global_step_N folder (resume_mode=resume_path)."
    )
    max_actor_ckpt_to_keep: int | None = Field(
        None, ge=1, description="Keep the last K checkpoints (actor and critic together); null: all."
    )
    rollout_data_dir: str | None = Field(None, description="Folder for JSONL dumps of every step's rollouts.")
    profile_steps: list[int] | None = Field(
        None,
        description="Steps to run under torch.profiler: log_dir/profile/step_N.txt (top ops by CPU and "
        "by device time) and step_N.json (a Chrome trace) of this process (the whole step in one "
        "process, the driver with Ray), and with Ray step_N_<role>_rank<R>.txt/.json of every rank "
        "(written on the rank's node).",
    )

    _loggers = field_validator("logger", mode="before")(_one_or_many)


def _split_urls(value: Any) -> Any:
    if isinstance(value, str):
        return [url.strip() for url in value.split(",") if url.strip()]
    return value


def _env_urls(var: str, fallback: str):
    def read() -> list[str]:
        return _split_urls(os.environ.get(var) or fallback)

    return read


class ServicesConfig(Section):
    data_url: list[str] = Field(
        default_factory=_env_urls("DATA_SERVER_URL", "http://127.0.0.1:8000"),
        description="data-server URL(s); several (comma-separated or a list) are replicas.",
        json_schema_extra={"env": "DATA_SERVER_URL", "fallback": "http://127.0.0.1:8000"},
    )
    reward_url: list[str] = Field(
        default_factory=_env_urls("REWARD_SERVER_URL", ""),
        description="reward-server URL(s). Set (here or by env) they make reward_model.mode=auto score "
        "through the reward-server; unset, rewards are scored in-process.",
        json_schema_extra={"env": "REWARD_SERVER_URL", "fallback": "none"},
    )
    retrieval_url: list[str] = Field(
        default_factory=_env_urls("RETRIEVAL_SERVER_URL", "http://127.0.0.1:8002"),
        description="retrieval-server URL(s) of the multi-turn search tool (when no tool config names one).",
        json_schema_extra={"env": "RETRIEVAL_SERVER_URL", "fallback": "http://127.0.0.1:8002"},
    )
    auth_token: str | None = Field(
        default_factory=lambda: os.environ.get("SERVICES_AUTH_TOKEN") or None,
        description="Bearer token sent to every service and rollout server (never printed); the env var "
        "keeps it off the command line.",
        json_schema_extra={"env": "SERVICES_AUTH_TOKEN", "fallback": "none"},
    )
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one HTTP request.")
    retries: int = Field(
        5,
        ge=0,
        description="Retries of a failed request (jittered exponential backoff), at the least; see "
        "retry_deadline_s.",
    )
    retry_deadline_s: float = Field(
        300.0,
        ge=0,
        description="Keep retrying an unreachable or failing service (5xx, 429) until this many seconds "
        "after the first failure, past `retries`, a try every 2.5-5 s: a service restarted in a job group "
        "takes tens of seconds. Each retry is logged with its URL, attempt and delay; then the "
        "run stops with one error line and a checkpoint. 0: stop after `retries`.",
    )
    health_timeout_s: float = Field(
        60.0, gt=0, description="At start, how long to wait for a needed service's /health."
    )

    _urls = field_validator("data_url", "reward_url", "retrieval_url", mode="before")(_split_urls)


class Config(Section):
    """Everything a training run needs; verl's `main_ppo` key names plus `services`."""

    data: DataConfig = Field(default_factory=DataConfig, description="Prompts.")
    actor_rollout_ref: ActorRolloutRefConfig = Field(
        default_factory=ActorRolloutRefConfig, description="Policy."
    )
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (PPO with gae).")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="Rewards.")
    custom_reward_function: CustomRewardFunction = Field(
        default_factory=CustomRewardFunction, description="User scoring function (local rewards)."
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL algorithm.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Run control.")
    services: ServicesConfig = Field(default_factory=ServicesConfig, description="Our HTTP services.")
    # verl keys the user set that change nothing here (trainer/config/accepted.py), for the start notice.
    _no_effect: list[str] = PrivateAttr(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def validates(self) -> bool:
        """Whether the run ever validates (trainer.test_freq > 0, val_before_train or val_only); when not,
        data.val_split / data.val_files are never opened."""
        trainer = self.trainer
        return trainer.test_freq > 0 or trainer.val_before_train or trainer.val_only

    @property
    def uses_ray(self) -> bool:
        """Ray role groups (trainer/parallel/settings.py) rather than the workers in the driver's process."""
        choice = self.trainer.use_ray
        return self.world_size > 1 if choice is None else choice

    @property
    def use_critic(self) -> bool:
        return bool(self.critic.enable)

    @property
    def use_reference(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def no_effect_keys(self) -> list[str]:
        return list(self._no_effect)

    def to_dict(self) -> dict[str, Any]:
        tree = self.model_dump(mode="json")
        for key in SECRET_KEYS:
            section, _, leaf = key.rpartition(".")
            if tree[section][leaf] is not None:
                tree[section][leaf] = "***"
        return tree

    def resolved_yaml(self) -> str:
        """The resolved configuration as YAML (secrets masked): what the run will actually use."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)
