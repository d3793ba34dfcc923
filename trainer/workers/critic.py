"""The critic worker (PPO with GAE): per-token values and the clipped value-loss update.

The value of response token t is the value head's output at the position just before it (P-1+t),
the state from which token t is generated, as in verl. Values are 0 off the response tokens. The
update mirrors the policy's: mini-batches, micro-batches with gradient accumulation under global
denominators, grad clipping, one LR-schedule step per update() call.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from trainer import algos
from trainer.algos import LossAggMode
from trainer.batch import TrainBatch
from trainer.model import autocast
from trainer.workers.actor import (
    OptimizerSettings,
    build_optimizer,
    clip_and_step,
    micro_batches,
    pad_response_columns,
    run_mini_batches,
)


@dataclass(frozen=True, kw_only=True)
class ValueLossSettings:
    """critic.* loss keys, resolved by the loop."""

    cliprange_value: float
    loss_agg_mode: LossAggMode
    max_response_len: int | None = None  # seq-mean-token-sum-norm's constant; None: the batch's T


def response_values(model: PreTrainedModel, batch: TrainBatch) -> Tensor:
    """Values [B, T] (fp32) of the batch's response tokens, 0 off them; in the caller's grad/autocast
    context.
    """
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    values = output.logits.squeeze(-1).float()  # [B, L]
    start = batch.prompt_width - 1
    values = values[:, start : start + batch.response_width]
    return values * batch.attention_mask[:, batch.prompt_width :]


class Critic:
    """The value model: values for GAE and its own clipped-loss update."""

    def __init__(
        self, model: PreTrainedModel, optim: OptimizerSettings, *, autocast_dtype: torch.dtype | None = None
    ) -> None:
        self.model = model
        self.optim = optim
        self.autocast_dtype = autocast_dtype
        self.optimizer, self.scheduler = build_optimizer(model, optim)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch, micro_batch_size: int) -> Tensor:
        parts = []
        for micro in micro_batches(batch, micro_batch_size, self.device):
            with autocast(self.device, self.autocast_dtype):
                parts.append(response_values(self.model, micro))
        return pad_response_columns(parts, batch.response_width).to(batch.response_mask.device)

    def update(
        self,
        batch: TrainBatch,
        *,
        mini_batch_size: int,
        micro_batch_size: int,
        ppo_epochs: int,
        loss: ValueLossSettings,
    ) -> dict[str, float]:
        """Fit the values to batch.returns, clipped around batch.values. Returns verl's critic/* metrics."""
        if batch.values is None or batch.returns is None:
            raise ValueError("Critic.update needs batch.values (before the update) and batch.returns")
        lr = self.scheduler.get_last_lr()[0]
        self.model.train()
        train = functools.partial(self._train_mini_batch, micro_batch_size=micro_batch_size, loss=loss)
        metrics = run_mini_batches(
            batch, mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs, train_mini_batch=train
        )
        self.scheduler.step()
        return {**metrics, "critic/lr": lr}

    def _train_mini_batch(
        self, mini_batch: TrainBatch, *, micro_batch_size: int, loss: ValueLossSettings
    ) -> dict[str, float]:
        total_tokens = max(float(mini_batch.response_mask.sum()), 1.0)
        denominators = {
            "num_tokens": total_tokens,
            "num_seqs": len(mini_batch),
            "max_response_len": loss.max_response_len or mini_batch.response_width,
        }
        sums: dict[str, float] = defaultdict(float)
        for micro in micro_batches(mini_batch, micro_batch_size, self.device):
            with autocast(self.device, self.autocast_dtype):
                values = response_values(self.model, micro)
            vf_loss, clipfrac = algos.value_loss(
                values,
                micro.values,
                micro.returns,
                micro.response_mask,
                cliprange_value=loss.cliprange_value,
                loss_agg_mode=loss.loss_agg_mode,
                **denominators,
            )
            vf_loss.backward()
            tokens = float(micro.response_mask.sum())
            sums["critic/vf_loss"] += float(vf_loss.detach())  # global denominators: partial sums add up
            sums["critic/vf_clipfrac"] += float(clipfrac) * tokens / total_tokens
            sums["critic/vpred_mean"] += (
                float(algos.masked_mean(values.detach(), micro.response_mask)) * tokens / total_tokens
            )
        sums["critic/grad_norm"] = clip_and_step(self.model, self.optimizer, self.optim.grad_clip)
        return dict(sums)

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
