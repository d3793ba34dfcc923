"""The trainer's one typed configuration: verl's `main_ppo` key tree, read the way verl reads it.

    config = load_config(["algorithm.adv_estimator=grpo", "trainer.logger=['console','jsonl']",
                          "--config", "run.yaml"])

One module per job:
    schema.py, run.py  the typed sections (pydantic): every key that does something, its default and bounds
    accepted.py        verl keys accepted with no effect here (reported once at start, not typed)
    keys.py            the schema's key tree: which dotted keys exist, the closest one to a typo
    cli.py             YAML files and Hydra overrides through OmegaConf -> a validated Config
    derive.py          `null: <rule>` defaults made concrete (per-GPU micro-batches, the critic's sizes)
    checks.py          what stops a run before any work (batch sizes, paths, world size), start notices
    reference.py       docs/config.md, generated from the schema (`python -m trainer.config --markdown`)

Components receive their own section (`config.actor_rollout_ref.actor`), never the whole Config.
Torch-free on purpose: the CLI, the docs and the launcher tests import it.
"""

from trainer.config.cli import ConfigError, load_config
from trainer.config.keys import config_keys
from trainer.config.reference import config_reference_markdown
from trainer.config.run import Config, ServicesConfig
from trainer.config.schema import CustomRewardFunction, RewardModelConfig

__all__ = [
    "Config",
    "ConfigError",
    "CustomRewardFunction",
    "RewardModelConfig",
    "ServicesConfig",
    "config_keys",
    "config_reference_markdown",
    "load_config",
]
