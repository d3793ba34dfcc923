"""The policy worker: sampled-token logprobs and entropy, and the PPO update with gradient accumulation.

Built once per run with its settings (optimizer, update sizes, loss, sampling temperature); the loop
then passes only data: `policy.compute_logprobs(batch)`, `policy.update(batch) -> metrics`. The update
loop, optimizer and checkpoint state are trainer/workers/common.py's; the chunked logprob computation is
trainer/workers/logprobs.py's. The policy's parameters stay fp32; on GPU forwards run under bf16
autocast (trainer/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from trainer import algos
from trainer.algos import KLKind, LossAggMode
from trainer.batch import TrainBatch
from trainer.config.derive import is_on_policy
from trainer.parallel.distributed import SINGLE_PROCESS, DataParallel
from trainer.workers.common import (
    MicroBatchSize,
    MiniBatchMetrics,
    OptimizerSettings,
    TrainedModel,
    UpdateSettings,
    global_denominators,
)
from trainer.workers.logprobs import (
    LogprobHead,
    ResponseLogprobs,
    batched_response_logprobs,
    response_logprobs,
)

LOSS_METRICS = ("actor/pg_loss", "actor/kl_loss")  # divided by global denominators: micro-batch parts add


@dataclass(frozen=True, kw_only=True)
class PolicyLossSettings:
    """actor_rollout_ref.actor.* loss keys, resolved when the run is built."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float  # dual-clip bound for negative advantages
    loss_agg_mode: LossAggMode
    entropy_coeff: float  # > 0 rewards entropy (subtracted from the loss)
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: KLKind
    max_response_len: int | None = None  # seq-mean-token-sum-norm's constant; None: the batch's T
    skip_zero_advantage_rows: bool = False  # applies only to a loss of the policy term alone

    @property
    def skips_zero_advantage_rows(self) -> bool:
        """Whether rows with all-zero advantages add nothing to the gradient: with a KL or entropy term
        they would."""
        return self.skip_zero_advantage_rows and not self.use_kl_loss and self.entropy_coeff == 0


class Policy(TrainedModel):
    """The trainable policy: model, AdamW, LR schedule; logprobs and the PPO update."""

    metric_prefix = "actor"

    def __init__(
        self,
        model: PreTrainedModel,
        optim: OptimizerSettings,
        update: UpdateSettings,
        loss: PolicyLossSettings,
        *,
        temperature: float = 1.0,
        log_prob_micro_batch_size: MicroBatchSize | None = None,
        autocast_dtype: torch.dtype | None = None,
        head: LogprobHead = LogprobHead(),
        dp: DataParallel = SINGLE_PROCESS,
    ) -> None:
        """temperature: the rollout's, so logprobs are taken under the distribution that sampled.
        log_prob_micro_batch_size: sequences per compute_logprobs forward (default: the update's).
        head: how the LM head's logprobs are computed (trainer/workers/logprobs.py).
        """
        super().__init__(model, optim, update, autocast_dtype=autocast_dtype, dp=dp)
        self.loss = loss
        self.temperature = temperature
        self.log_prob_micro_batch_size = log_prob_micro_batch_size or update.micro
        self.head = head

    def is_on_policy(self, batch_size: int) -> bool:
        """Whether update() of a batch this size may skip old_logprobs (see `is_on_policy`)."""
        return is_on_policy(batch_size, self.update_settings.mini_batch_size, self.update_settings.ppo_epochs)

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> ResponseLogprobs:
        """[B, T] logprobs (and entropy) of the batch's responses under the current weights."""
        return batched_response_logprobs(
            self.model,
            batch,
            self.log_prob_micro_batch_size,
            temperature=self.temperature,
            with_entropy=with_entropy,
            autocast_dtype=self.autocast_dtype,
            head=self.head,
            dp=self.dp,
        )

    def check_update_inputs(self, batch: TrainBatch) -> None:
        """batch needs advantages; old_logprobs unless exactly on-policy; ref_logprobs for the KL loss."""
        if batch.advantages is None:
            raise ValueError("Policy.update needs batch.advantages")
        if batch.old_logprobs is None and not self.is_on_policy(len(batch)):
            raise ValueError(
                "old_logprobs may be omitted only when the update is exactly on-policy (one mini-batch, "
                f"one epoch); got B={len(batch)}, {self.update_settings}"
            )
        if self.loss.use_kl_loss and batch.ref_logprobs is None:
            raise ValueError("use_kl_loss needs batch.ref_logprobs")

    def train_mini_batch(self, mini_batch: TrainBatch) -> MiniBatchMetrics:
        """Accumulate the micro-batches' gradients (the optimizer step is the caller's)."""
        denominators = global_denominators(mini_batch, self.loss.max_response_len, self.dp)
        trained_tokens = denominators["num_tokens"]
        if self.loss.skips_zero_advantage_rows:  # the denominators stay the whole mini-batch's
            mini_batch = rows_with_signal(mini_batch, self.dp)
            (trained_tokens,) = self.dp.sum_floats(float(mini_batch.response_mask.sum()))
        metrics = MiniBatchMetrics(trained_tokens, LOSS_METRICS)
        for micro in self.micro_batches(mini_batch):
            with self.autocast():
                out = response_logprobs(
                    self.model,
                    micro,
                    temperature=self.temperature,
                    with_entropy=True,  # logged every step; a gradient only when it is in the loss
                    entropy_grad=self.loss.entropy_coeff != 0,
                    head=self.head,
                )
            terms = policy_loss_terms(out, micro, self.loss, denominators)
            terms.pop("total").backward()
            metrics.add(terms, tokens=micro.response_mask.sum())
        return metrics


def rows_with_signal(mini_batch: TrainBatch, dp: DataParallel = SINGLE_PROCESS) -> TrainBatch:
    """The rows whose advantages are not all zero, in order, for a loss of the policy term alone: the
    PPO term of a token is -A * ratio (clipped), so a row with A = 0 everywhere has exactly zero gradient
    and needs no forward or backward. Every rank trains the same number of rows (under FSDP each micro-
    batch's forward and backward are collectives), a rank with fewer rows with signal filling up with
    rows without; and at least one row, so that every parameter gets its (zero) gradient and AdamW steps
    as it would have (a parameter without a gradient is not stepped at all)."""
    signal = ((mini_batch.advantages != 0) & mini_batch.response_mask.bool()).any(dim=1).tolist()
    wanted = dp.max_int(max(sum(signal), 1))
    if wanted >= len(mini_batch):
        return mini_batch
    first = sorted(range(len(mini_batch)), key=lambda row: not signal[row])  # stable: rows with signal first
    return mini_batch.select(sorted(first[:wanted]))


def policy_loss_terms(
    out: ResponseLogprobs, micro: TrainBatch, loss: PolicyLossSettings, denominators: dict
) -> dict:
    """The micro-batch's total loss (key "total") and its metric values: detached 0-dim tensors, left on
    the device (turning them into floats here would stall every micro-batch until its forward is done)."""
    old_logprobs = micro.old_logprobs if micro.old_logprobs is not None else out.logprobs.detach()
    mask = micro.response_mask
    policy = algos.ppo_policy_loss(
        out.logprobs,
        old_logprobs,
        micro.advantages,
        mask,
        clip_ratio_low=loss.clip_ratio_low,
        clip_ratio_high=loss.clip_ratio_high,
        clip_ratio_c=loss.clip_ratio_c,
        loss_agg_mode=loss.loss_agg_mode,
        **denominators,
    )
    total = policy.loss
    if loss.entropy_coeff != 0:
        entropy_loss = algos.aggregate_loss(out.entropy, mask, loss.loss_agg_mode, **denominators)
        total = total - loss.entropy_coeff * entropy_loss
    terms = {
        "actor/pg_loss": policy.loss.detach(),
        "actor/pg_clipfrac": policy.clipfrac.detach(),
        "actor/pg_clipfrac_lower": policy.clipfrac_lower.detach(),
        "actor/ppo_kl": policy.approx_kl.detach(),
        "actor/entropy": algos.masked_mean(out.entropy.detach(), mask),
    }
    if micro.old_logprobs is None and micro.rollout_logprobs is not None:
        terms |= engine_gap_terms(micro.rollout_logprobs, out.logprobs.detach(), mask)
    if loss.use_kl_loss:
        kl = algos.kl_penalty(out.logprobs, micro.ref_logprobs, loss.kl_loss_type)
        kl_loss = algos.aggregate_loss(kl, mask, loss.loss_agg_mode, **denominators)
        total = total + loss.kl_loss_coef * kl_loss
        terms.update({"actor/kl_loss": kl_loss.detach(), "actor/kl_coef": loss.kl_loss_coef})
    return {"total": total, **terms}


def engine_gap_terms(rollout_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """The engine's sampled-token logprobs against the update's own, as per-token means.

    An exactly on-policy step has no old_log_prob pass to compare the engine with, so the update's forward
    (the same weights, before its one optimizer step) stands in for it. Means add up over micro-batches
    and ranks; the whole-batch max, std and correlation of `rollout_logprob_gap` do not, so they are
    logged only by steps that run old_log_prob.
    """
    engine, trainer = rollout_logprobs.float(), logprobs.float()
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_mean": algos.masked_mean((engine.exp() - trainer.exp()).abs(), mask),
        "training/rollout_logprob_diff_mean": algos.masked_mean((engine - trainer).abs(), mask),
    }
