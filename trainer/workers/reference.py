"""The reference worker: the frozen initial policy's logprobs, for the KL loss or the KL reward penalty.

Same chunked computation and temperature as the policy's (trainer/workers/logprobs.py), so at step 0
the reference and policy logprobs are identical and every KL estimate is exactly 0.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from trainer.batch import TrainBatch
from trainer.parallel.distributed import SINGLE_PROCESS, DataParallel
from trainer.workers.common import MicroBatchSize
from trainer.workers.logprobs import LogprobHead, batched_response_logprobs


class Reference:
    """A frozen policy: logprobs only, no optimizer, nothing to checkpoint (resume reloads the model)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        micro_batch_size: MicroBatchSize,
        temperature: float = 1.0,
        autocast_dtype: torch.dtype | None = None,
        head: LogprobHead = LogprobHead(),
        dp: DataParallel = SINGLE_PROCESS,
    ) -> None:
        """micro_batch_size: sequences (or a TokenBudget) per forward; temperature: the rollout's, as
        the policy's; dp: the ranks it is sharded over, which must run the same number of forwards."""
        self.model = model.eval().requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.dp = dp
        self.temperature = temperature
        self.autocast_dtype = autocast_dtype
        self.head = head

    def compute_logprobs(self, batch: TrainBatch) -> Tensor:
        """[B, T] sampled-token logprobs under the reference, 0 on padding."""
        return batched_response_logprobs(
            self.model,
            batch,
            self.micro_batch_size,
            temperature=self.temperature,
            with_entropy=False,
            autocast_dtype=self.autocast_dtype,
            head=self.head,
            dp=self.dp,
        ).logprobs
