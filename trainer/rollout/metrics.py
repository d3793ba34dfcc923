"""How far the rollout engine's logprobs are from the trainer's: log it every step.

The engine samples with its own kernels and dtype (bf16 on GPU); the trainer recomputes the same
tokens' logprobs with its forward. A growing gap means the rollout is more off-policy than the
algorithm assumes (or an engine bug). Names and math follow verl's `training/rollout_probs_diff_*`
(absolute difference of the token *probabilities*, over response tokens) and its Pearson correlation
of the probabilities; `training/rollout_logprob_diff_mean` adds the mean absolute logprob difference.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rollout_logprob_gap(rollout_logprobs: Tensor, trainer_logprobs: Tensor, response_mask: Tensor) -> dict:
    """[B, R] logprobs from the engine and from the trainer (same tokens), [B, R] mask -> metrics."""
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {"training/rollout_probs_diff_valid": 0.0}
    engine = rollout_logprobs.detach().float()[mask]
    trainer = trainer_logprobs.detach().float().to(engine.device)[mask.to(engine.device)]
    engine_probs, trainer_probs = engine.exp(), trainer.exp()
    probs_diff = (engine_probs - trainer_probs).abs()
    metrics = {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": probs_diff.max().item(),
        "training/rollout_probs_diff_mean": probs_diff.mean().item(),
        "training/rollout_probs_diff_std": probs_diff.std().item() if probs_diff.numel() > 1 else 0.0,
        "training/rollout_logprob_diff_mean": (engine - trainer).abs().mean().item(),
    }
    if engine_probs.numel() > 1 and engine_probs.std() > 0 and trainer_probs.std() > 0:
        stacked = torch.stack([engine_probs, trainer_probs])
        metrics["training/rollout_actor_probs_pearson_corr"] = torch.corrcoef(stacked)[0, 1].item()
    return metrics
