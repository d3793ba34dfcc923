"""Sampled-token logprobs and entropy of a batch's responses, computed chunk by chunk.

The backbone yields hidden states [B, L, H]; only the T positions that predict response tokens go
through the LM head, `chunk_size` tokens at a time, keeping each token's sampled logprob and entropy.
A full fp32 [B, L, V] tensor never exists. Logits are divided by the sampling temperature first, the
same distribution the rollout engine reports logprobs under (trainer/rollout/base.py). The policy (with
gradients) and the reference (without) both use it, so at step 0 their logprobs are identical and every
KL estimate is exactly 0.

Two ways through the head (`LogprobHead.fused`):
- fused (default): `FusedHeadLogprobs`, an autograd function with its own backward. Forward keeps per
  token only the log-normaliser `lse`, the logprob and the entropy; backward recomputes each chunk's
  logits and forms their gradient in closed form,

      d logprob / d z = onehot(target) - p          d entropy / d z = -p * (log p + entropy)

  (z = logits / temperature, p = softmax(z)), then two matmuls give the hidden-state and head-weight
  gradients. With `compiled`, the per-chunk math after the logits matmul is one torch.compile'd
  function each way (trainer/compiling.py), which reads the low-precision logits once instead of
  materialising fp32 copies of them.
- plain: each chunk under activation checkpointing, autograd through log_softmax (the reference the
  fused path is tested against).

`entropy_grad=False` (actor.entropy_coeff == 0) still returns the entropy, for the metric, but no
gradient flows through it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from trainer import algos
from trainer.batch import TrainBatch
from trainer.compiling import CompiledOrEager
from trainer.parallel.distributed import SINGLE_PROCESS, DataParallel
from trainer.parallel.fsdp import compute_device, in_root_forward, release_gathered
from trainer.model import autocast, backbone_and_head
from trainer.packing import is_packed, response_hidden_states, shares_prompts
from trainer.workers.common import MicroBatchSize, micro_batches, pad_response_columns

log = logging.getLogger(__name__)

# tokens per LM-head chunk: 2048 x 151936 bf16 logits = 0.6 GB. On an H100 the 0.5B update's forward +
# backward ran 202 ms a micro-batch of 64 sequences at 2048, 210-217 ms at 1024 and 4096 (actor_mfu.py)
DEFAULT_LOGITS_CHUNK_SIZE = 2048


@dataclass(frozen=True)
class LogprobHead:
    """How the LM head's logprobs are computed (see the module docstring)."""

    chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE
    fused: bool = True  # FusedHeadLogprobs; False: checkpointed chunks through autograd
    compiled: bool = False  # torch.compile the fused per-chunk math (on CUDA; CPU stays eager)


@dataclass(frozen=True)
class ResponseLogprobs:
    logprobs: Tensor  # [B, T] sampled-token logprobs, 0 on padding
    entropy: Tensor | None  # [B, T] entropy of the temperature-scaled distribution, 0 on padding


# ------------------------------------------------------------------------------ the fused head


def chunk_stats(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """logits [n, V] (any float dtype), targets [n] -> (logprob, entropy, lse) [n] each, in fp32."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprob = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(dim=-1)
    return logprob, entropy, lse


def chunk_logits_grad(
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
) -> Tensor:
    """d loss / d logits [n, V] in the logits' dtype, from the upstream gradients [n] of logprob and
    entropy (None: entropy carries no gradient)."""
    z = logits.float() / temperature
    p = torch.exp(z - lse[:, None])
    grad_z = -grad_logprob[:, None] * p
    if grad_entropy is not None:
        grad_z = grad_z - grad_entropy[:, None] * p * (z - lse[:, None] + entropy[:, None])
    grad_z = grad_z.scatter_add(-1, targets[:, None], grad_logprob[:, None])
    return (grad_z / temperature).to(logits.dtype)


# the vocabulary (the reduced dimension) stays a compile-time constant; the row count is symbolic from the
# first call, as the last chunk of a batch is shorter
_STATS = CompiledOrEager(chunk_stats, dynamic=None, dynamic_rows=True)
_LOGITS_GRAD = CompiledOrEager(chunk_logits_grad, dynamic=None, dynamic_rows=True)


def add_weight_grad(grad_weight: Tensor, grad_logits: Tensor, hidden: Tensor) -> Tensor:
    """grad_weight (fp32 [V, H]) + grad_logits.T @ hidden (low precision [n, V] and [n, H]).

    On CUDA the matmul accumulates into fp32 itself (addmm with out_dtype): one pass over [V, H] a
    chunk instead of a low-precision product, its fp32 copy and an add, which took as long as the
    matmul for a 151k vocabulary. Elsewhere (or where torch lacks it): product, cast, add.
    """
    if grad_logits.is_cuda and grad_logits.dtype in (torch.bfloat16, torch.float16) and _ADDMM_FP32[0]:
        try:
            return torch.addmm(grad_weight, grad_logits.T, hidden, out_dtype=torch.float32)
        except torch.OutOfMemoryError:  # a RuntimeError, but no sign of a torch without the overload
            raise
        except (RuntimeError, TypeError) as exc:  # a torch without addmm(out_dtype=...) for these dtypes
            log.warning(
                "torch.addmm(out_dtype=float32) failed (%s): the head-weight gradient takes the slower "
                "product, cast and add from now on",
                exc,
            )
            _ADDMM_FP32[0] = False
    return grad_weight + (grad_logits.T @ hidden).float()


_ADDMM_FP32 = [True]  # whether add_weight_grad may use addmm(out_dtype=float32); off after a failure


class FusedHeadLogprobs(torch.autograd.Function):
    """(hidden [N, H], head weight [V, H], targets [N]) -> (logprob [N], entropy [N]) in fp32, chunked."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, compute_dtype, head: LogprobHead, entropy_grad):
        stats = _STATS if head.compiled and hidden.is_cuda else chunk_stats
        w = weight.to(compute_dtype)
        parts = [
            stats(
                hidden[s : s + head.chunk_size].to(compute_dtype) @ w.T,
                targets[s : s + head.chunk_size],
                temperature,
            )
            for s in range(0, hidden.shape[0], head.chunk_size)
        ]
        logprob, entropy, lse = (torch.cat(column) for column in zip(*parts))
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.settings = (temperature, compute_dtype, head, entropy_grad)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, compute_dtype, head, entropy_grad = ctx.settings
        logits_grad = _LOGITS_GRAD if head.compiled and hidden.is_cuda else chunk_logits_grad
        if grad_logprob is None:
            grad_logprob = torch.zeros_like(lse)
        if not entropy_grad:
            grad_entropy = None
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], head.chunk_size):
            e = s + head.chunk_size
            h = hidden[s:e].to(compute_dtype)
            grad_logits = logits_grad(
                h @ w.T,
                targets[s:e],
                lse[s:e],
                entropy[s:e],
                grad_logprob[s:e],
                grad_entropy[s:e] if grad_entropy is not None else None,
                temperature,
            )
            if grad_hidden is not None:
                grad_hidden[s:e] = grad_logits @ w
            if ctx.needs_input_grad[1]:
                grad_weight = add_weight_grad(grad_weight, grad_logits, h)
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None, None


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """What the head's matmul runs in: autocast's dtype when it is on, else the inputs' common dtype."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _fusable(head: torch.nn.Module) -> bool:
    return isinstance(head, torch.nn.Linear) and head.bias is None


# ------------------------------------------------------------------------------ the plain path


def _chunk_logprobs(
    hidden: Tensor,
    targets: Tensor,
    head: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
    """hidden [N, H], targets [N] -> (logprob [N], entropy [N]) in fp32."""
    logits = head(hidden).float() / temperature
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    if entropy_grad:
        return logprobs, algos.entropy_from_logits(logits)
    with torch.no_grad():
        return logprobs, algos.entropy_from_logits(logits.detach())


def response_logprobs(
    model: PreTrainedModel,
    batch: TrainBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    head: LogprobHead = LogprobHead(),
) -> ResponseLogprobs:
    """Logprobs (and entropy) of the batch's response tokens under `model`, computed chunk by chunk.

    Runs in the caller's grad / autocast context; gradients flow into the model when enabled (through
    the entropy only if `entropy_grad`). A model set up for padding removal (trainer/packing.py) runs
    the micro-batch packed; an FSDP-sharded one runs it as one forward of its root (trainer/parallel/fsdp.py).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute logprobs, got {temperature}")
    return in_root_forward(model, _response_logprobs, batch, temperature, with_entropy, entropy_grad, head)


def _response_logprobs(
    model: PreTrainedModel,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    settings: LogprobHead,
) -> ResponseLogprobs:
    backbone, head = backbone_and_head(model)
    # the hidden states at the positions predicting the real response tokens (loss-masked or not)
    hidden_rows, tokens = response_hidden_states(
        backbone, batch, remove_padding=is_packed(model), share_prompts=shares_prompts(model)
    )
    targets = tokens.take(batch.responses)
    if settings.fused and _fusable(head) and targets.numel():
        dtype = _compute_dtype(hidden_rows, head.weight)
        logprob, entropy = FusedHeadLogprobs.apply(
            hidden_rows, head.weight, targets, temperature, dtype, settings, with_entropy and entropy_grad
        )
    else:
        logprob, entropy = _plain_head(
            hidden_rows, targets, head, temperature, with_entropy, entropy_grad, settings
        )
    logprobs = tokens.place(logprob)
    return ResponseLogprobs(logprobs=logprobs, entropy=tokens.place(entropy) if with_entropy else None)


def _plain_head(hidden_rows, targets, head, temperature, with_entropy, entropy_grad, settings: LogprobHead):
    logprob_parts, entropy_parts = [], []
    for start in range(0, targets.shape[0], settings.chunk_size):
        args = (
            hidden_rows[start : start + settings.chunk_size],
            targets[start : start + settings.chunk_size],
            head,
            temperature,
            with_entropy,
            entropy_grad,
        )
        if torch.is_grad_enabled():
            logprob, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logprob, entropy = _chunk_logprobs(*args)
        logprob_parts.append(logprob)
        entropy_parts.append(entropy)
    if not logprob_parts:
        empty = hidden_rows.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprob_parts), torch.cat(entropy_parts)


@torch.no_grad()
def batched_response_logprobs(
    model: PreTrainedModel,
    batch: TrainBatch,
    micro_batch_size: MicroBatchSize,
    *,
    temperature: float,
    with_entropy: bool,
    autocast_dtype: torch.dtype | None,
    head: LogprobHead,
    dp: DataParallel = SINGLE_PROCESS,
) -> ResponseLogprobs:
    """response_logprobs over the whole batch, micro-batch by micro-batch, without gradients."""
    device = compute_device(model)
    logprob_parts, entropy_parts = [], []
    for micro in micro_batches(batch, micro_batch_size, device, dp, shared_prompts=shares_prompts(model)):
        with autocast(device, autocast_dtype):
            out = response_logprobs(
                model, micro, temperature=temperature, with_entropy=with_entropy, head=head
            )
        logprob_parts.append(out.logprobs)
        entropy_parts.append(out.entropy)
    release_gathered(model)
    width, home = batch.response_width, batch.response_mask.device
    return ResponseLogprobs(
        logprobs=pad_response_columns(logprob_parts, width).to(home),
        entropy=pad_response_columns(entropy_parts, width).to(home) if with_entropy else None,
    )
