"""Sampled-token logprobs and entropy of a batch's responses, computed chunk by chunk.

The backbone yields hidden states [B, L, H]; only the T positions that predict response tokens go
through the LM head, `chunk_size` tokens at a time, keeping each token's sampled logprob and entropy.
A full fp32 [B, L, V] tensor never exists: under autograd each chunk is checkpointed, so backward
recomputes one chunk's logits at a time instead of keeping all of them alive. Logits are divided by
the sampling temperature first, the same distribution the rollout engine reports logprobs under
(trainer/rollout/base.py). The policy (with gradients) and the reference (without) both use it, so at
step 0 their logprobs are identical and every KL estimate is exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from trainer import algos
from trainer.batch import TrainBatch
from trainer.fsdp import compute_device, in_root_forward
from trainer.model import autocast, backbone_and_head
from trainer.packing import is_packed, response_hidden_states
from trainer.workers.common import micro_batches, pad_response_columns

DEFAULT_LOGITS_CHUNK_SIZE = 1024  # tokens per LM-head chunk: 1024 x 151936 fp32 logits = 0.6 GB


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

    Runs in the caller's grad / autocast context; gradients flow into the model when enabled. A model
    set up for padding removal (trainer/packing.py) runs the micro-batch packed; an FSDP-sharded one
    runs it as one forward of its root (trainer/fsdp.py).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute logprobs, got {temperature}")
    return in_root_forward(model, _response_logprobs, batch, temperature, with_entropy, chunk_size)


def _response_logprobs(
    model: PreTrainedModel, batch: TrainBatch, temperature: float, with_entropy: bool, chunk_size: int
) -> ResponseLogprobs:
    backbone, head = backbone_and_head(model)
    # the hidden states at the positions predicting the real response tokens (loss-masked or not)
    hidden_rows, real = response_hidden_states(backbone, batch, remove_padding=is_packed(model))
    targets = batch.responses[real]
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
    logprobs = hidden_rows.new_zeros(real.shape, dtype=torch.float32)
    logprobs = logprobs.masked_scatter(real, torch.cat(logprob_parts)) if logprob_parts else logprobs
    entropy = None
    if with_entropy:
        entropy = logprobs.new_zeros(real.shape)
        entropy = entropy.masked_scatter(real, torch.cat(entropy_parts)) if entropy_parts else entropy
    return ResponseLogprobs(logprobs=logprobs, entropy=entropy)


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
    device = compute_device(model)
    logprob_parts, entropy_parts = [], []
    for micro in micro_batches(batch, micro_batch_size, device):
        with autocast(device, autocast_dtype):
            out = response_logprobs(
                model, micro, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size
            )
        logprob_parts.append(out.logprobs)
        entropy_parts.append(out.entropy)
    width, home = batch.response_width, batch.response_mask.device
    return ResponseLogprobs(
        logprobs=pad_response_columns(logprob_parts, width).to(home),
        entropy=pad_response_columns(entropy_parts, width).to(home) if with_entropy else None,
    )
