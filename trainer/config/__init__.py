"""The trainer's one typed configuration: verl's `main_ppo` key tree, read the way verl reads it.

    config = load_config(["algorithm.adv_estimator=grpo", "trainer.logger=['console','jsonl']",
                          "--config", "run.yaml"])

One module per job:
    schema.py, run.py  the typed sections (pydantic): every key that does something, its default and bounds
    accepted.py        verl keys accepted with no effect here (reported once at start, not typed)
    cli.py             YAML files and Hydra overrides through OmegaConf -> a validated Config
    derive.py          `null: <rule>` defaults made concrete (per-GPU micro-batches, the critic's sizes)
    checks.py          what stops a run before any work (batch sizes, paths, world size), start notices
    reference.py       docs/config.md, generated from the schema (`python -m trainer.config --markdown`)

Components receive their own section (`config.actor_rollout_ref.actor`), never the whole Config.
Torch-free on purpose: the CLI, the docs and the launcher tests import it.
"""

from trainer.config.accepted import NO_EFFECT_KEYS
from trainer.config.checks import model_path_problem
from trainer.config.cli import ConfigError, load_config, read_yaml_config, split_argv
from trainer.config.keys import config_keys, unknown_key_message
from trainer.config.reference import config_reference_markdown
from trainer.config.run import Config, ServicesConfig, TrainerConfig
from trainer.config.schema import (
    SECRET_KEYS,
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    CriticConfig,
    CustomRewardFunction,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RewardModelConfig,
    RolloutConfig,
    Section,
)

__all__ = [
    "NO_EFFECT_KEYS",
    "SECRET_KEYS",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "CustomRewardFunction",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RefConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "Section",
    "ServicesConfig",
    "TrainerConfig",
    "config_keys",
    "config_reference_markdown",
    "load_config",
    "model_path_problem",
    "read_yaml_config",
    "split_argv",
    "unknown_key_message",
]
