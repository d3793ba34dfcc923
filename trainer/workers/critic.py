"""The critic worker (PPO with GAE): per-token values and the clipped value-loss update.

The value of response token t is the value head's output at the position just before it (P-1+t),
the state from which token t is generated, as in verl. Values are 0 off the response tokens. The
update loop (mini-batches, micro-batches with gradient accumulation under global denominators, grad
clipping, one LR-schedule step per update() call) is trainer/workers/common.py's, shared with the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from trainer import algos
from trainer.algos import LossAggMode
from trainer.batch import TrainBatch
from trainer.parallel.distributed import SINGLE_PROCESS, DataParallel
from trainer.parallel.fsdp import in_root_forward, release_gathered
from trainer.model import backbone_and_head
from trainer.packing import is_packed, response_hidden_states, shares_prompts
from trainer.workers.common import (
    MicroBatchSize,
    MiniBatchMetrics,
    OptimizerSettings,
    TrainedModel,
    UpdateSettings,
    global_denominators,
    pad_response_columns,
)


@dataclass(frozen=True, kw_only=True)
class ValueLossSettings:
    """critic.* loss keys, resolved when the run is built."""

    cliprange_value: float
    loss_agg_mode: LossAggMode
    max_response_len: int | None = None  # seq-mean-token-sum-norm's constant; None: the batch's T


def response_values(model: PreTrainedModel, batch: TrainBatch) -> Tensor:
    """Values [B, T] (fp32) of the batch's response tokens, 0 off them; in the caller's grad/autocast
    context. Runs as one forward of the FSDP root when the model is sharded (trainer/parallel/fsdp.py).
    """
    return in_root_forward(model, _response_values, batch)


def _response_values(model: PreTrainedModel, batch: TrainBatch) -> Tensor:
    backbone, head = backbone_and_head(model)
    hidden, tokens = response_hidden_states(
        backbone, batch, remove_padding=is_packed(model), share_prompts=shares_prompts(model)
    )
    return tokens.place(head(hidden).squeeze(-1).float())  # only the positions predicting response tokens


class Critic(TrainedModel):
    """The value model: values for GAE and its own clipped-loss update."""

    metric_prefix = "critic"

    def __init__(
        self,
        model: PreTrainedModel,
        optim: OptimizerSettings,
        update: UpdateSettings,
        loss: ValueLossSettings,
        *,
        forward_micro_batch_size: MicroBatchSize | None = None,
        autocast_dtype: torch.dtype | None = None,
        dp: DataParallel = SINGLE_PROCESS,
    ) -> None:
        """forward_micro_batch_size: sequences per compute_values forward (default: the update's)."""
        super().__init__(model, optim, update, autocast_dtype=autocast_dtype, dp=dp)
        self.loss = loss
        self.forward_micro_batch_size = forward_micro_batch_size or update.micro

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> Tensor:
        """[B, T] values of the batch's response tokens under the current weights."""
        parts = []
        for micro in self.micro_batches(batch, self.forward_micro_batch_size):
            with self.autocast():
                parts.append(response_values(self.model, micro))
        release_gathered(self.model)
        return pad_response_columns(parts, batch.response_width).to(batch.response_mask.device)

    def check_update_inputs(self, batch: TrainBatch) -> None:
        if batch.values is None or batch.returns is None:
            raise ValueError("Critic.update needs batch.values (before the update) and batch.returns")

    def train_mini_batch(self, mini_batch: TrainBatch) -> MiniBatchMetrics:
        """Fit the values to returns, clipped around the values before the update (verl's critic/*)."""
        denominators = global_denominators(mini_batch, self.loss.max_response_len, self.dp)
        metrics = MiniBatchMetrics(denominators["num_tokens"], ("critic/vf_loss",))
        for micro in self.micro_batches(mini_batch):
            with self.autocast():
                values = response_values(self.model, micro)
            vf_loss, clipfrac = algos.value_loss(
                values,
                micro.values,
                micro.returns,
                micro.response_mask,
                cliprange_value=self.loss.cliprange_value,
                loss_agg_mode=self.loss.loss_agg_mode,
                **denominators,
            )
            vf_loss.backward()
            vpred_mean = algos.masked_mean(values.detach(), micro.response_mask)
            metrics.add(
                {
                    "critic/vf_loss": vf_loss.detach(),
                    "critic/vf_clipfrac": clipfrac.detach(),
                    "critic/vpred_mean": vpred_mean,
                },
                tokens=micro.response_mask.sum(),
            )
        return metrics
