"""The RL math of the trainer: advantage estimators, PPO losses, KL penalties, loss aggregation.

Every function here is a pure function of tensors (no config objects, no models, no I/O), so each
one is unit-tested with hand-computed numbers. Semantics and numerical guards follow verl's
`verl/trainer/ppo/core_algos.py`; the departures are listed below.

Shapes: B = sequences in the batch (prompts x n samples), T = padded response length, V = vocabulary.
`response_mask` [B, T] is 1.0 on the response tokens that count in the loss and 0.0 on padding (and on
tool-output tokens in multi-turn rollouts). Padded entries of every [B, T] input must be finite.

Advantage estimators (all computed without gradient; they are constants for the policy update):
- grpo (DeepSeekMath, Shao et al. 2024): outcome reward only. Advantage = (score - group mean) /
  (group std + eps), the same value on every response token. The std is the unbiased (n - 1) one, as
  in verl. A group of one gets mean 0 and std 1 (verl), so its advantage is its raw score.
  Departure from verl: a group whose scores are all equal gets advantage exactly 0. verl (and a plain
  float mean) can miss equal scores by a rounding step, which the division by std + 1e-6 blows up:
  six fp32 scores of 0.3 got +0.029 each. `group_stats` snaps such a group's mean to its score.
  `norm_by_std=False` is Dr. GRPO (Liu et al. 2025): dividing by the std up-weights questions that are
  almost always right or always wrong; the other half of Dr. GRPO is loss_agg_mode
  "seq-mean-token-sum-norm".
- rloo (Ahmadian et al. 2024): score minus the mean of the *other* n - 1 samples of the group,
  i.e. n / (n - 1) * (score - group mean). A group of one keeps its raw score (no baseline), as verl.
- reinforce_plus_plus (Hu 2025): discounted return-to-go of the token rewards (where a KL penalty in the
  reward lands per token), whitened over all response tokens of the batch, not per group.
  Departure from verl: masked positions are skipped (they neither add reward nor discount), like GAE,
  where verl resets the running return at them. Identical for right-padding; for tool-output tokens
  in the middle of a response verl's reset would cut the final reward off from the earlier tokens.
- reinforce_plus_plus_baseline: the group mean is subtracted from the score (GRPO without the std),
  then the result is whitened over all response tokens of the batch (a batch std, not a group std).
- Which scores enter a group's statistics (grpo, rloo, reinforce_plus_plus_baseline): every response's
  own score, also that of a response with no loss tokens (all tool output, or masked out), as in verl.
  It is still a sample of the policy's reward on that prompt, so dropping it (or counting it as 0)
  would bias the baseline; it gets no advantage, having no token to put it on.
  With the KL penalty in the reward, a response's outcome is its score minus its KL summed over its
  loss tokens (verl's token_level_rewards.sum(-1)).
- gae (Schulman et al. 2016): GAE over response tokens; masked positions are skipped (their value and
  TD error do not enter the recursion), as verl. Returns = advantages + values before whitening (the
  critic's targets); the advantages are then whitened over the batch. Value clipping is `value_loss`.

Policy loss: PPO clip (Schulman et al. 2017) with separate ratio bounds [1 - clip_ratio_low,
1 + clip_ratio_high]: DAPO's clip-higher (Yu et al. 2025) raises only the upper one so unlikely tokens
can still grow. Dual clip (Ye et al. 2020): for negative advantages the loss is also capped at
-advantage * clip_ratio_c, so one token whose ratio exploded cannot dominate the step. The log-ratio is
clamped to [-20, 20] before exp (verl) so the ratio stays finite.

KL: `kl_penalty` gives Schulman's per-token estimators of KL(pi || pi_ref) (k1, k2 = 0.5 log-ratio^2,
k3 = low_var_kl, clamped to [-10, 10] as verl; and abs). It is used as a loss term (use_kl_loss) or
subtracted from the token rewards (`apply_kl_in_reward`, InstructGPT style) with a fixed or adaptive
coefficient (Ziegler et al. 2019's proportional controller, error clipped to +-0.2).

Aggregation (`aggregate_loss`) of a [B, T] loss matrix:
  token-mean               sum(loss * mask) / num_tokens
  seq-mean-token-sum       sum_i sum_t(loss * mask) / num_seqs
  seq-mean-token-mean      sum_i [sum_t(loss * mask) / tokens_i] / num_seqs
  seq-mean-token-sum-norm  sum_i [sum_t(loss * mask) / max_response_len] / num_seqs   (Dr. GRPO)
num_tokens counts the loss tokens; num_seqs counts the sequences with at least one loss token, as verl's
agg_loss does: a response whose tokens are all masked has nothing to train on and must not dilute the
mean of the others (`count_loss_sequences`). seq-mean-token-sum-norm divides by num_seqs as Dr. GRPO
writes it (1/G); verl's agg_loss omits that and divides by the number of micro-batches instead.
Beyond verl: num_tokens / num_seqs may be the GLOBAL counts of the whole mini-batch (verl's legacy
worker counts each micro-batch's own rows). Every mode is then a plain sum over sequences divided by a
constant, so the losses (and gradients) of micro-batches add up to exactly the mini-batch's:
micro-batch 1 x accumulation 8 == 8 x 1, whatever the padding of each micro-batch. With data
parallelism where gradients are averaged over W ranks, scale the loss by W.

DAPO extras live elsewhere: the soft overlong punishment is reward shaping (services/scoring/shaping.py),
and dynamic sampling, which drops the groups whose scores are all equal, filters whole prompt groups in
trainer/loop.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
KLKind = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)

# Numerical guards, the same values as verl.
MAX_ABS_LOG_RATIO = 20.0  # exp(20) ~ 4.9e8: finite in fp32 and bf16
MAX_ABS_LOW_VAR_KL = 10.0
WHITEN_EPS = 1e-8
ADAPTIVE_KL_MAX_ERROR = 0.2


# ---------------------------------------------------------------------------------------------- masks


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask is set. x, mask [...]; -> scalar, or x reduced over `dim`."""
    product = x * mask
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x where mask is set; 0 (not NaN) where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased (Bessel-corrected) variance of x over the masked positions (scalar).

    One or zero masked positions give 0 (verl raises there), so whitening a degenerate batch yields
    zeros instead of NaN.
    """
    variance = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    count = mask.sum()
    return variance * torch.where(count > 1, count / (count - 1), torch.zeros_like(count))


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) with the statistics of the masked positions; 0 off the mask.
    x, mask [B, T] -> [B, T]."""
    whitened = (x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + WHITEN_EPS)
    return whitened * mask


# --------------------------------------------------------------------------------- group statistics


def _check_outcome_inputs(scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> None:
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores and group_ids must both be [B]; got {tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"response_mask must be [B={scores.shape[0]}, T]; got {tuple(response_mask.shape)}")


def group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample, the mean, unbiased std and size of its group.

    scores [B] float, group_ids [B] int -> (mean [B], std [B], size [B] int64). A group of one has std 0,
    and so has a group of equal scores, exactly (see below).
    """
    _, group_index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sizes = counts.to(scores.dtype)
    means = torch.zeros_like(sizes).index_add_(0, group_index, scores) / sizes
    # Equal scores must give deviations of exactly 0. Their float mean can miss them by a rounding step
    # (six fp32 0.3s average to 0.3 - 3e-8), and GRPO's / (std + 1e-6) would blow that up to 0.03.
    empty = torch.zeros_like(sizes)
    group_min = empty.scatter_reduce(0, group_index, scores, reduce="amin", include_self=False)
    group_max = empty.scatter_reduce(0, group_index, scores, reduce="amax", include_self=False)
    means = torch.where(group_min == group_max, group_max, means)
    squared_deviations = (scores - means[group_index]) ** 2
    sums_of_squares = torch.zeros_like(sizes).index_add_(0, group_index, squared_deviations)
    stds = (sums_of_squares / (sizes - 1).clamp(min=1)).sqrt()
    return means[group_index], stds[group_index], counts[group_index]


# ------------------------------------------------------------------------------ advantage estimators


@torch.no_grad()
def grpo_advantages(
    scores: Tensor, group_ids: Tensor, response_mask: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO (norm_by_std=True) or Dr. GRPO (False). scores [B], group_ids [B] -> advantages [B, T]."""
    _check_outcome_inputs(scores, group_ids, response_mask)
    group_mean, group_std, group_size = group_stats(scores, group_ids)
    alone = group_size == 1
    baseline = torch.where(alone, torch.zeros_like(group_mean), group_mean)
    advantages = scores - baseline
    if norm_by_std:
        advantages = advantages / (torch.where(alone, torch.ones_like(group_std), group_std) + eps)
    return advantages.unsqueeze(-1) * response_mask


@torch.no_grad()
def rloo_advantages(scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> Tensor:
    """Leave-one-out baseline. scores [B], group_ids [B] -> advantages [B, T]."""
    _check_outcome_inputs(scores, group_ids, response_mask)
    group_mean, _, group_size = group_stats(scores, group_ids)
    n = group_size.to(scores.dtype)
    # score - mean(others) = n / (n - 1) * (score - mean(all))
    leave_one_out = (scores - group_mean) * n / (n - 1).clamp(min=1)
    advantages = torch.where(group_size > 1, leave_one_out, scores)
    return advantages.unsqueeze(-1) * response_mask


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Return-to-go sum_{k>=t} gamma^(k-t) r_k over the masked tokens. [B, T] -> [B, T], 0 off the mask."""
    returns = torch.zeros_like(token_rewards)
    running_return = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        keep = response_mask[:, t]
        running_return = keep * (token_rewards[:, t] + gamma * running_return) + (1 - keep) * running_return
        returns[:, t] = running_return
    return returns * response_mask


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0
) -> Tensor:
    """REINFORCE++: whitened discounted returns. token_rewards [B, T] -> advantages [B, T]."""
    return masked_whiten(discounted_returns(token_rewards, response_mask, gamma=gamma), response_mask)


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    scores: Tensor, group_ids: Tensor, response_mask: Tensor
) -> Tensor:
    """REINFORCE++ with a group-mean baseline, whitened over the batch. scores [B] -> advantages [B, T]."""
    _check_outcome_inputs(scores, group_ids, response_mask)
    group_mean, _, group_size = group_stats(scores, group_ids)
    centred = scores - torch.where(group_size == 1, torch.zeros_like(group_mean), group_mean)
    return masked_whiten(centred.unsqueeze(-1) * response_mask, response_mask)


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE. token_rewards, values [B, T] -> (whitened advantages [B, T], returns [B, T]), 0 off the mask."""
    next_value = torch.zeros_like(values[:, 0])
    running_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        td_error = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = td_error + gamma * lam * running_advantage
        keep = response_mask[:, t]  # a masked token passes the next value and advantage through unchanged
        next_value = keep * values[:, t] + (1 - keep) * next_value
        running_advantage = keep * advantage_t + (1 - keep) * running_advantage
        advantages[:, t] = running_advantage
    returns = (advantages + values) * response_mask
    return masked_whiten(advantages, response_mask), returns


@torch.no_grad()
def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Put each sequence's score on its last response token. scores [B] -> token rewards [B, T].

    A sequence with no response token gets no reward (it has nothing to train on either).
    """
    batch_size, length = response_mask.shape
    positions = torch.arange(length, device=response_mask.device).expand(batch_size, length)
    last_position = torch.where(response_mask > 0, positions, -1).amax(dim=-1)  # [B]
    rows = torch.nonzero(last_position >= 0).squeeze(-1)
    token_rewards = torch.zeros(batch_size, length, dtype=scores.dtype, device=scores.device)
    token_rewards[rows, last_position[rows]] = scores[rows]
    return token_rewards


# ----------------------------------------------------------------------------------------- KL terms


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs. [B, T] -> [B, T]."""
    log_ratio = logprobs - ref_logprobs  # log pi / pi_ref
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        ref_log_ratio = (ref_logprobs - logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
        # pi_ref/pi - log(pi_ref/pi) - 1 >= 0: unbiased, low variance (Schulman's k3)
        low_var_kl = ref_log_ratio.exp() - ref_log_ratio - 1
        return low_var_kl.clamp(-MAX_ABS_LOW_VAR_KL, MAX_ABS_LOW_VAR_KL)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)}")


@dataclass
class FixedKLController:
    """A constant KL coefficient (algorithm.kl_ctrl.type=fixed)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Ziegler et al. 2019: steer the coefficient to target_kl, proportionally, over `horizon` samples."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0; got {target_kl}, {horizon}")
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """current_kl: the batch's mean KL; n_steps: samples in the batch."""
        proportional_error = current_kl / self.target_kl - 1
        proportional_error = min(max(proportional_error, -ADAPTIVE_KL_MAX_ERROR), ADAPTIVE_KL_MAX_ERROR)
        self.value *= 1 + proportional_error * n_steps / self.horizon


@torch.no_grad()
def apply_kl_in_reward(
    token_scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float,
    kind: KLKind = "k1",
) -> tuple[Tensor, Tensor]:
    """token_rewards = token_scores - kl_coef * kl, per token. All [B, T] -> (token_rewards [B, T], kl [B]).

    The second output is each sequence's mean KL; its batch mean is what a KL controller's `update`
    takes (with n_steps = B), as verl does.
    """
    kl = kl_penalty(logprobs, ref_logprobs, kind) * response_mask
    return token_scores - kl_coef * kl, masked_mean(kl, response_mask, dim=-1)


# -------------------------------------------------------------------------------------- aggregation


def count_loss_sequences(mask: Tensor) -> Tensor:
    """The sequences with at least one loss token: the seq-mean-* modes' num_seqs. mask [B, T] -> scalar."""
    return (mask.sum(dim=-1) > 0).sum()


def _check_denominator(name: str, value: float | Tensor | None) -> None:
    if isinstance(value, (int, float)) and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: LossAggMode,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_response_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar (see the module docstring for the four modes).

    num_tokens / num_seqs: the GLOBAL counts of the mini-batch this micro-batch belongs to; None uses
    this batch's own (mask.sum() / count_loss_sequences(mask)). max_response_len: the constant of
    seq-mean-token-sum-norm; None uses T, which is only right when every micro-batch is padded to the
    same length.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.shape != mask.shape:
        raise ValueError(
            f"loss {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must have the same shape"
        )
    _check_denominator("num_tokens", num_tokens)
    _check_denominator("num_seqs", num_seqs)
    if mode == "token-mean":
        if num_tokens is None:
            return masked_mean(loss_mat, mask)
        return masked_sum(loss_mat, mask) / num_tokens
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # [B] token sums
    if mode == "seq-mean-token-mean":
        tokens_per_seq = mask.sum(dim=-1)
        seq_losses = seq_losses / torch.where(
            tokens_per_seq > 0, tokens_per_seq, torch.ones_like(tokens_per_seq)
        )
    elif mode == "seq-mean-token-sum-norm":
        _check_denominator("max_response_len", max_response_len)
        seq_losses = seq_losses / (loss_mat.shape[-1] if max_response_len is None else max_response_len)
    if num_seqs is None:
        num_seqs = count_loss_sequences(mask).clamp(min=1)  # no loss token at all: the sum is 0 anyway
    return seq_losses.sum() / num_seqs


# ----------------------------------------------------------------------------------------- losses


@dataclass
class PolicyLossOutput:
    """The PPO policy loss and its diagnostics (verl: actor/pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl).

    The diagnostics are masked means over this (micro-)batch's own tokens, detached.
    """

    loss: Tensor
    clipfrac: Tensor  # share of tokens where the clipped ratio set the loss
    clipfrac_lower: Tensor  # share of tokens where the dual clip (negative advantage) set it
    approx_kl: Tensor  # mean of log(pi_old / pi): verl's ppo_kl


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_response_len: int | None = None,
) -> PolicyLossOutput:
    """PPO clip with clip-higher and dual clip. All inputs [B, T]; gradient flows through `logprobs`."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1.0, got {clip_ratio_c}")
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * clipped_ratio
    ppo_loss = torch.maximum(unclipped_loss, clipped_loss)  # the pessimistic (clipped) objective
    dual_clip_loss = -advantages * clip_ratio_c
    negative = advantages < 0
    token_loss = torch.where(negative, torch.minimum(ppo_loss, dual_clip_loss), ppo_loss)
    loss = aggregate_loss(
        token_loss,
        response_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_response_len=max_response_len,
    )
    with torch.no_grad():
        clipfrac = masked_mean((clipped_loss > unclipped_loss).to(ratio.dtype), response_mask)
        clipfrac_lower = masked_mean(((ppo_loss > dual_clip_loss) & negative).to(ratio.dtype), response_mask)
        approx_kl = masked_mean(-log_ratio, response_mask)
    return PolicyLossOutput(loss=loss, clipfrac=clipfrac, clipfrac_lower=clipfrac_lower, approx_kl=approx_kl)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: LossAggMode = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_response_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2). [B, T] -> (loss, clipfrac)."""
    clipped_values = torch.maximum(
        torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value
    )
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate_loss(
        torch.maximum(unclipped_error, clipped_error),
        response_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_response_len=max_response_len,
    )
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > unclipped_error).to(values.dtype), response_mask)
    return loss, clipfrac


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits). [..., V] -> [...], in fp32.

    Upcasts to fp32, so callers pass chunks of the sequence, never a whole [B, T, V] batch at once.
    Logits must be finite (model outputs are); a -inf logit would give NaN.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)
