"""The policy worker: sampled-token logprobs and entropy, and the PPO update with gradient accumulation.

Logprobs are computed in chunks along the sequence: the backbone yields hidden states [B, L, H]; only
the T positions that predict response tokens go through the LM head, `logits_chunk_size` tokens at a
time, keeping each token's sampled logprob and entropy. A full fp32 [B, L, V] tensor never exists:
under autograd each chunk is checkpointed, so backward recomputes one chunk's logits at a time
instead of keeping all of them alive. Logits are divided by the sampling temperature first, the same
distribution the rollout engine reports logprobs under (trainer/rollout/base.py).

The update (verl's dp_actor.update_policy, in our terms):
    for each of ppo_epochs:
        for each mini-batch (ppo_mini_batch_size sequences):     -> one optimizer step
            for each micro-batch (ppo_micro_batch_size sequences): forward, loss, backward (accumulate)
            clip the gradient norm, step AdamW
    step the LR schedule once (its warmup and horizon count training steps, as in verl)
Each micro-batch's loss is aggregated with the mini-batch's GLOBAL token and sequence counts
(algos.aggregate_loss), so the summed micro-batch gradients equal the mini-batch gradient exactly:
micro-batch 1 x accumulation 8 gives the same parameters as 8 x 1. Under data parallelism these counts
must be all-reduced over ranks (the distributed issue).

The policy's parameters stay fp32; on GPU forwards run under bf16 autocast (trainer/model.py).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from trainer import algos
from trainer.algos import KLKind, LossAggMode
from trainer.batch import TrainBatch
from trainer.model import autocast, backbone_and_head

DEFAULT_LOGITS_CHUNK_SIZE = 1024  # tokens per LM-head chunk: 1024 x 151936 fp32 logits = 0.6 GB


# ------------------------------------------------------------------------------ chunked logprobs


@dataclass(frozen=True)
class ResponseLogprobs:
    logprobs: Tensor  # [B, T] sampled-token logprobs, 0 on padding
    entropy: Tensor | None  # [B, T] entropy of the temperature-scaled distribution, 0 on padding


def _chunk_logprobs(
    hidden: Tensor, targets: Tensor, head: torch.nn.Module, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """hidden [N, H], targets [N] -> (logprob [N], entropy [N]) in fp32."""
    logits = head(hidden).float() / temperature
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    entropy = algos.entropy_from_logits(logits) if with_entropy else torch.zeros_like(logprobs)
    return logprobs, entropy


def response_logprobs(
    model: PreTrainedModel,
    batch: TrainBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE,
) -> ResponseLogprobs:
    """Logprobs (and entropy) of the batch's response tokens under `model`, computed chunk by chunk.

    Runs in the caller's grad / autocast context; gradients flow into the model when enabled.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute logprobs, got {temperature}")
    backbone, head = backbone_and_head(model)
    hidden = backbone(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state
    prompt_width, response_width = batch.prompt_width, batch.response_width
    # position P-1+t predicts response token t
    predicting = hidden[:, prompt_width - 1 : prompt_width - 1 + response_width]
    real = batch.attention_mask[:, prompt_width:].bool()  # real response tokens (loss-masked or not)
    hidden_rows, targets = predicting[real], batch.responses[real]
    logprob_parts, entropy_parts = [], []
    for start in range(0, targets.shape[0], chunk_size):
        args = (
            hidden_rows[start : start + chunk_size],
            targets[start : start + chunk_size],
            head,
            temperature,
            with_entropy,
        )
        if torch.is_grad_enabled():
            logprob, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logprob, entropy = _chunk_logprobs(*args)
        logprob_parts.append(logprob)
        entropy_parts.append(entropy)
    logprobs = hidden.new_zeros(real.shape, dtype=torch.float32)
    logprobs = logprobs.masked_scatter(real, torch.cat(logprob_parts)) if logprob_parts else logprobs
    entropy = None
    if with_entropy:
        entropy = logprobs.new_zeros(real.shape)
        entropy = entropy.masked_scatter(real, torch.cat(entropy_parts)) if entropy_parts else entropy
    return ResponseLogprobs(logprobs=logprobs, entropy=entropy)


def micro_batches(batch: TrainBatch, size: int, device: torch.device) -> Iterator[TrainBatch]:
    """Micro-batches of `size` sequences on `device`, each trimmed to its own padding."""
    for micro in batch.split(size):
        yield micro.trimmed().to(device)


def pad_response_columns(parts: list[Tensor], width: int) -> Tensor:
    """Concatenate [b_i, T_i] tensors of trimmed micro-batches into [B, width], zero-padded."""
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


@torch.no_grad()
def batched_response_logprobs(
    model: PreTrainedModel,
    batch: TrainBatch,
    micro_batch_size: int,
    *,
    temperature: float,
    with_entropy: bool,
    autocast_dtype: torch.dtype | None,
    chunk_size: int,
) -> ResponseLogprobs:
    """response_logprobs over the whole batch, micro-batch by micro-batch, without gradients."""
    device = next(model.parameters()).device
    logprob_parts, entropy_parts = [], []
    for micro in micro_batches(batch, micro_batch_size, device):
        with autocast(device, autocast_dtype):
            out = response_logprobs(
                model, micro, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size
            )
        logprob_parts.append(out.logprobs)
        entropy_parts.append(out.entropy)
    width = batch.response_width
    return ResponseLogprobs(
        logprobs=pad_response_columns(logprob_parts, width).to(batch.response_mask.device),
        entropy=pad_response_columns(entropy_parts, width).to(batch.response_mask.device)
        if with_entropy
        else None,
    )


# ------------------------------------------------------------------------------ optimizer, schedule


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """actor_rollout_ref.actor.optim.* / critic.optim.* and grad_clip, resolved by the loop.

    warmup_steps and total_steps count training steps (one update() call each).
    """

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float | None  # max global grad norm; None or <= 0: no clipping (the norm is still logged)
    warmup_steps: int
    total_steps: int
    schedule: Literal["constant", "cosine"]  # optim.lr_scheduler_type
    min_lr_ratio: float  # cosine decays to lr * min_lr_ratio
    eps: float = 1e-8  # AdamW's epsilon; no verl key sets it


def lr_multiplier(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """The LR factor for training step `step` (0-based).

    Linear warmup reaches the full LR at step warmup_steps - 1 (verl starts at 0, wasting a step);
    then constant, or a half cosine from 1 down to min_lr_ratio at total_steps.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, settings: OptimizerSettings):
    """AdamW over the trainable parameters, and its LambdaLR schedule."""
    if settings.schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown LR schedule {settings.schedule!r}; expected 'constant' or 'cosine'")
    parameters = [p for p in model.parameters() if p.requires_grad]
    fused = parameters[0].device.type == "cuda"
    optimizer = torch.optim.AdamW(
        parameters,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        fused=fused or None,
    )
    multiplier = functools.partial(
        lr_multiplier,
        warmup_steps=settings.warmup_steps,
        total_steps=settings.total_steps,
        schedule=settings.schedule,
        min_lr_ratio=settings.min_lr_ratio,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None) -> float:
    """Clip the global grad norm and step; a non-finite norm skips the step. Returns the pre-clip norm."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    max_norm = grad_clip if grad_clip and grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


class MetricAccumulator:
    """Running metrics of one update(): token-weighted sums within a mini-batch, means over mini-batches."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.totals[name] += value
            self.counts[name] += 1

    def means(self) -> dict[str, float]:
        return {name: self.totals[name] / self.counts[name] for name in self.totals}


def run_mini_batches(
    batch: TrainBatch,
    *,
    mini_batch_size: int,
    ppo_epochs: int,
    train_mini_batch: Callable[[TrainBatch], dict],
) -> dict[str, float]:
    """ppo_epochs passes over the batch's consecutive mini-batches; the metrics' means."""
    if mini_batch_size < 1 or ppo_epochs < 1:
        raise ValueError(f"mini_batch_size and ppo_epochs must be >= 1; got {mini_batch_size}, {ppo_epochs}")
    metrics = MetricAccumulator()
    for _ in range(ppo_epochs):
        for mini_batch in batch.split(mini_batch_size):
            metrics.add(train_mini_batch(mini_batch))
    return metrics.means()


def is_on_policy(batch_size: int, mini_batch_size: int, ppo_epochs: int) -> bool:
    """True when update() takes exactly one optimizer step on the whole batch.

    Then the policy that sampled is the one being updated, so old_logprobs equal the update's own
    logprobs (detached) and the separate old-logprob forward can be skipped: pass old_logprobs=None.
    """
    return ppo_epochs == 1 and mini_batch_size >= batch_size


# ------------------------------------------------------------------------------------- the worker


@dataclass(frozen=True, kw_only=True)
class PolicyLossSettings:
    """actor_rollout_ref.actor.* loss keys, resolved by the loop."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float  # dual-clip bound for negative advantages
    loss_agg_mode: LossAggMode
    entropy_coeff: float  # > 0 rewards entropy (subtracted from the loss)
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: KLKind
    max_response_len: int | None = None  # seq-mean-token-sum-norm's constant; None: the batch's T


class Policy:
    """The trainable policy: model, AdamW, LR schedule; logprobs and the PPO update."""

    def __init__(
        self,
        model: PreTrainedModel,
        optim: OptimizerSettings,
        *,
        autocast_dtype: torch.dtype | None = None,
        logits_chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE,
    ) -> None:
        self.model = model
        self.optim = optim
        self.autocast_dtype = autocast_dtype
        self.logits_chunk_size = logits_chunk_size
        self.optimizer, self.scheduler = build_optimizer(model, optim)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def compute_logprobs(
        self,
        batch: TrainBatch,
        micro_batch_size: int,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> ResponseLogprobs:
        return batched_response_logprobs(
            self.model,
            batch,
            micro_batch_size,
            temperature=temperature,
            with_entropy=with_entropy,
            autocast_dtype=self.autocast_dtype,
            chunk_size=self.logits_chunk_size,
        )

    def update(
        self,
        batch: TrainBatch,
        *,
        mini_batch_size: int,
        micro_batch_size: int,
        ppo_epochs: int,
        loss: PolicyLossSettings,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """PPO epochs over mini-batches; one LR-schedule step. Returns verl's actor/* metrics.

        Sizes count sequences: mini_batch_size = verl's ppo_mini_batch_size (prompts) x rollout.n,
        micro_batch_size = ppo_micro_batch_size_per_gpu. batch needs advantages; old_logprobs may be None
        only when is_on_policy(...); ref_logprobs
        when loss.use_kl_loss.
        """
        _check_update_inputs(batch, mini_batch_size, ppo_epochs, loss)
        lr = self.scheduler.get_last_lr()[0]
        self.model.train()
        train = functools.partial(
            self._train_mini_batch, micro_batch_size=micro_batch_size, loss=loss, temperature=temperature
        )
        metrics = run_mini_batches(
            batch, mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs, train_mini_batch=train
        )
        self.scheduler.step()
        return {**metrics, "actor/lr": lr}

    def _train_mini_batch(
        self, mini_batch: TrainBatch, *, micro_batch_size: int, loss: PolicyLossSettings, temperature: float
    ) -> dict[str, float]:
        """Accumulate the micro-batches' gradients, then one optimizer step. Token-weighted metrics."""
        total_tokens = float(mini_batch.response_mask.sum())
        denominators = {
            "num_tokens": max(total_tokens, 1.0),
            "num_seqs": len(mini_batch),
            "max_response_len": loss.max_response_len or mini_batch.response_width,
        }
        sums: dict[str, float] = defaultdict(float)
        for micro in micro_batches(mini_batch, micro_batch_size, self.device):
            with autocast(self.device, self.autocast_dtype):
                out = response_logprobs(
                    self.model,
                    micro,
                    temperature=temperature,
                    with_entropy=True,
                    chunk_size=self.logits_chunk_size,
                )
            terms = policy_loss_terms(out, micro, loss, denominators)
            terms.pop("total").backward()
            tokens = float(micro.response_mask.sum())
            for name, value in terms.items():
                # losses are already global-denominator partial sums; rates are local means -> weight by
                # tokens
                sums[name] += value if name in ("actor/pg_loss", "actor/kl_loss") else value * tokens
        metrics = {
            name: (value if name in ("actor/pg_loss", "actor/kl_loss") else value / max(total_tokens, 1.0))
            for name, value in sums.items()
        }
        metrics["actor/grad_norm"] = clip_and_step(self.model, self.optimizer, self.optim.grad_clip)
        return metrics

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _check_update_inputs(
    batch: TrainBatch, mini_batch_size: int, ppo_epochs: int, loss: PolicyLossSettings
) -> None:
    if batch.advantages is None:
        raise ValueError("Policy.update needs batch.advantages")
    if batch.old_logprobs is None and not is_on_policy(len(batch), mini_batch_size, ppo_epochs):
        raise ValueError(
            "old_logprobs may be omitted only when the update is exactly on-policy "
            f"(one mini-batch, one epoch); got B={len(batch)}, mini_batch_size={mini_batch_size}, "
            f"ppo_epochs={ppo_epochs}"
        )
    if loss.use_kl_loss and batch.ref_logprobs is None:
        raise ValueError("use_kl_loss needs batch.ref_logprobs")


def policy_loss_terms(
    out: ResponseLogprobs, micro: TrainBatch, loss: PolicyLossSettings, denominators: dict
) -> dict:
    """The micro-batch's total loss (a tensor, key "total") and its metric values (floats)."""
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
        "actor/pg_loss": float(policy.loss.detach()),
        "actor/pg_clipfrac": float(policy.clipfrac),
        "actor/pg_clipfrac_lower": float(policy.clipfrac_lower),
        "actor/ppo_kl": float(policy.approx_kl),
        "actor/entropy": float(algos.masked_mean(out.entropy.detach(), mask)),
    }
    if loss.use_kl_loss:
        kl = algos.kl_penalty(out.logprobs, micro.ref_logprobs, loss.kl_loss_type)
        kl_loss = algos.aggregate_loss(kl, mask, loss.loss_agg_mode, **denominators)
        total = total + loss.kl_loss_coef * kl_loss
        terms.update({"actor/kl_loss": float(kl_loss.detach()), "actor/kl_coef": loss.kl_loss_coef})
    return {"total": total, **terms}
