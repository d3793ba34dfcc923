"""Trainer: a GRPO/PPO fit loop with verl-compatible CLI, checkpoints and metrics."""
