"""python -m trainer.main_ppo key=value ...   — verl's `main_ppo` command line for this trainer.

Parses YAML files and overrides into the typed Config (trainer/config/), refuses a bad one with one
line per problem and exit code 2 before any work, prints the resolved config and the start notices
(an engine substituted, verl keys accepted with no effect), then runs the fit loop.
"""

from __future__ import annotations

import sys

from trainer.config import ConfigError, checks, load_config

USAGE = """\
usage: python -m trainer.main_ppo [--config FILE.yaml ...] [--dry-run] key=value ...

Train a policy with GRPO / PPO (verl's main_ppo keys). Examples:

  python -m trainer.main_ppo algorithm.adv_estimator=grpo \\
      data.train_files=~/data/gsm8k/train.parquet data.val_files=~/data/gsm8k/test.parquet \\
      actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.rollout.n=5 \\
      trainer.logger=['console','jsonl']

  python -m trainer.main_ppo --config run.yaml trainer.total_training_steps=10

The command line is read as verl reads it: Hydra overrides (key=value, +key=value, ~key; values such
as 1e-6, true, null, [a,b], {k: v}, 'quoted'), YAML files merged first, ${...} interpolation including
${oc.env:VAR,default}. --dry-run checks and prints the resolved configuration without training.

Every key, its type, default and meaning: docs/config.md, or
  python -m trainer.config --markdown
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE, end="")
        return 0
    dry_run = "--dry-run" in argv
    argv = [item for item in argv if item != "--dry-run"]
    try:
        config = load_config(argv)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        print("(python -m trainer.main_ppo --help for usage)", file=sys.stderr)
        return 2
    print(config.resolved_yaml(), end="", flush=True)
    for notice in checks.notices(config):
        print(notice, flush=True)
    if dry_run:
        return 0
    from services.common.client import ServiceError
    from trainer import loop  # imported here: torch and the models load only once the config is good
    from trainer.checkpoint import CheckpointError, CheckpointWriteError
    from trainer.data import PromptTooLongError
    from trainer.model import ModelUnavailable
    from trainer.rewards import RewardErrors

    try:
        loop.fit(config)
    except (
        loop.TrainingAborted,
        ServiceError,
        PromptTooLongError,
        CheckpointWriteError,
        CheckpointError,
        RewardErrors,
        ModelUnavailable,
    ) as exc:
        # A service that never became healthy or stayed down, a checkpoint folder that turned unwritable,
        # rewards that could not be computed, a model not on disk offline, a checkpoint that cannot be
        # resumed: one line, no traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
