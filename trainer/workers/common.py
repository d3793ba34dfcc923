"""What the trainable roles (policy, critic) share: batching, AdamW and its LR schedule, the update loop.

One update(), verl's dp_actor.update_policy in our terms:
    for each of ppo_epochs:
        for each mini-batch (mini_batch_size sequences):      -> one optimizer step
            for each micro-batch (micro_batch_size sequences): forward, loss, backward (accumulate)
            clip the gradient norm, step AdamW
    step the LR schedule once (its warmup and horizon count training steps, as in verl)
Each micro-batch's loss is aggregated with the mini-batch's GLOBAL token and sequence counts
(`global_denominators`, algos.aggregate_loss), so the summed micro-batch gradients equal the mini-batch
gradient exactly: micro-batch 1 x accumulation 8 gives the same parameters as 8 x 1. Under data
parallelism these counts are summed over the ranks first (trainer/parallel/distributed.py).
"""

from __future__ import annotations

import functools
import logging
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from trainer import algos
from trainer.batch import TrainBatch
from trainer.config.derive import MicroBatchSize, TokenBudget
from trainer.parallel.distributed import SINGLE_PROCESS, DataParallel
from trainer.parallel.fsdp import compute_device, full_tensor
from trainer.model import autocast
from trainer.packing import same_group_as_previous, shares_prompts

log = logging.getLogger("trainer")

# ------------------------------------------------------------------------------------------ batching


def token_budget_bounds(lengths: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges, consecutive, each within `max_tokens` unless it is one long row."""
    bounds, start, tokens = [], 0, 0
    for row, length in enumerate(lengths):
        if row > start and tokens + length > max_tokens:
            bounds.append((start, row))
            start, tokens = row, 0
        tokens += length
    if lengths:
        bounds.append((start, len(lengths)))
    return bounds


def even_bounds(lengths: list[int], parts: int) -> list[tuple[int, int]]:
    """`parts` consecutive non-empty row ranges (parts <= rows) whose token sums are near total / parts."""
    if not 1 <= parts <= len(lengths):
        raise ValueError(f"cannot cut {len(lengths)} rows into {parts} non-empty micro-batches")
    total, bounds, start, running = sum(lengths), [], 0, 0
    for row, length in enumerate(lengths):
        running += length
        cuts_left = parts - 1 - len(bounds)
        rows_left = len(lengths) - row - 1
        if cuts_left and (running >= total * (len(bounds) + 1) / parts or rows_left == cuts_left):
            bounds.append((start, row + 1))
            start = row + 1
    bounds.append((start, len(lengths)))
    return bounds


def budget_units(batch: TrainBatch, max_tokens: int, shared_prompts: bool) -> tuple[list[int], list[int]]:
    """The pieces a token budget cuts a batch between, as (each one's first row, its tokens): every row;
    or, where the model shares prompts (trainer/packing.py `pack_shared`), every run of one group's
    consecutive rows, its prompt counted once as the layers run it, unless the run alone is over the
    budget (then its rows, each counted whole). A cut inside a run runs its prompt once more."""
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    if not shared_prompts:
        return list(range(len(lengths))), lengths
    prompts = batch.prompt_lengths.tolist()
    continues = [False, *same_group_as_previous(batch).tolist()]
    firsts, costs, row = [], [], 0
    while row < len(lengths):
        end = next((r for r in range(row + 1, len(lengths)) if not continues[r]), len(lengths))
        cost = prompts[row] + sum(lengths[r] - prompts[r] for r in range(row, end))
        if cost <= max_tokens:
            firsts.append(row)
            costs.append(cost)
        else:
            firsts += range(row, end)
            costs += lengths[row:end]
        row = end
    return firsts, costs


def micro_batches(
    batch: TrainBatch,
    size: MicroBatchSize,
    device: torch.device,
    dp: DataParallel = SINGLE_PROCESS,
    *,
    shared_prompts: bool = False,
) -> Iterator[TrainBatch]:
    """Micro-batches on `device`, each trimmed to its own padding: `size` sequences each, or within a
    TokenBudget (cut between `budget_units`: whole prompt groups where the model shares prompts). Under
    data parallelism a budget gives every rank the same number of micro-batches (the most any rank
    needs, each rank's rows re-cut evenly by tokens), because every sharded forward and backward is a
    collective that all ranks must run together."""
    if not isinstance(size, TokenBudget):
        yield from (micro.trimmed().to(device) for micro in batch.split(size))
        return
    firsts, costs = budget_units(batch, size.max_tokens, shared_prompts)
    bounds = token_budget_bounds(costs, size.max_tokens)
    count = dp.max_int(len(bounds))
    if count != len(bounds) and count <= len(costs):
        bounds = even_bounds(costs, count)
    elif count != len(bounds):  # another rank needs more micro-batches than this one has pieces: rows
        firsts, costs = budget_units(batch, size.max_tokens, shared_prompts=False)
        bounds = even_bounds(costs, count)
    ends = [*firsts[1:], len(batch)]
    for start, stop in bounds:
        yield batch.select(range(firsts[start], ends[stop - 1])).trimmed().to(device)


def pad_response_columns(parts: list[Tensor], width: int) -> Tensor:
    """Concatenate [b_i, T_i] tensors of trimmed micro-batches into [B, width], zero-padded."""
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


@dataclass(frozen=True, kw_only=True)
class UpdateSettings:
    """How one update() walks its batch. Sizes count sequences (verl's prompt counts x rollout.n)."""

    mini_batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per forward / backward
    ppo_epochs: int = 1  # passes over the batch
    token_budget: TokenBudget | None = None  # use_dynamic_bsz: replaces micro_batch_size

    def __post_init__(self) -> None:
        if min(self.mini_batch_size, self.micro_batch_size, self.ppo_epochs) < 1:
            raise ValueError(f"update sizes and ppo_epochs must be >= 1; got {self}")

    @property
    def micro(self) -> MicroBatchSize:
        return self.token_budget or self.micro_batch_size


def global_denominators(mini_batch: TrainBatch, max_response_len: int | None, dp: DataParallel) -> dict:
    """algos.aggregate_loss's num_tokens / num_seqs / max_response_len for every micro-batch of it.

    Under data parallelism `mini_batch` is this rank's share: the counts are summed over the ranks, so
    every rank divides by the whole mini-batch's and their gradients add up to the global gradient.
    """
    mask = mini_batch.response_mask
    tokens, seqs = dp.sum_floats(float(mask.sum()), float(algos.count_loss_sequences(mask)))
    return {
        "num_tokens": max(tokens, 1.0),
        "num_seqs": max(int(seqs), 1),
        "max_response_len": max_response_len or mini_batch.response_width,
    }


# ------------------------------------------------------------------------------ optimizer, schedule


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """actor_rollout_ref.actor.optim.* / critic.optim.* and grad_clip, resolved when the run is built.

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
    # fused on every device: one kernel launch a step, and the only implementation that can skip a step
    # on the device (clip_and_step's found_inf), without the host waiting to read the grad norm
    optimizer = torch.optim.AdamW(
        parameters,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        fused=True,
    )
    multiplier = functools.partial(
        lr_multiplier,
        warmup_steps=settings.warmup_steps,
        total_steps=settings.total_steps,
        schedule=settings.schedule,
        min_lr_ratio=settings.min_lr_ratio,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def clip_and_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None
) -> Tensor:
    """Clip the global grad norm and step; a non-finite norm skips the step. Returns the pre-clip norm.

    Nothing here waits for the device: the norm stays a device tensor and the skip is the optimizer's
    `found_inf` (as GradScaler uses it; torch's fused optimizers take it), so the host queues the clip
    and the step behind the backward instead of draining the GPU to read the norm first (~27 ms idle an
    update in a profile).
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    max_norm = grad_clip if grad_clip and grad_clip > 0 else float("inf")
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(parameters, max_norm))  # FSDP: a DTensor
    optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


# ------------------------------------------------------------------------------------------ metrics


class MiniBatchMetrics:
    """One mini-batch's metrics, summed over its micro-batches (and over the data-parallel ranks).

    Loss terms are already divided by the mini-batch's global denominators, so their micro-batch parts
    add up; every other value is a per-token mean of its micro-batch, weighted here by its tokens out of
    the whole mini-batch's (`total_tokens`, summed over ranks). Values may be device tensors: the sums
    stay on the device and reach the host once, in `result` (one wait a mini-batch, not one a value).
    """

    def __init__(self, total_tokens: float, loss_names: tuple[str, ...]) -> None:
        self.total_tokens = max(total_tokens, 1.0)
        self.loss_names = loss_names
        self.sums: dict[str, Tensor | float] = {}

    def add(self, values: dict[str, Tensor | float], tokens: Tensor | float) -> None:
        for name, value in values.items():
            weight = 1.0 if name in self.loss_names else tokens / self.total_tokens
            value = value.detach().double() if isinstance(value, Tensor) else value
            self.sums[name] = self.sums.get(name, 0.0) + value * weight

    def result(
        self, dp: DataParallel = SINGLE_PROCESS, same: dict[str, Tensor] | None = None
    ) -> dict[str, float]:
        """The sums over the ranks, and `same` (values every rank holds alike, as the global grad norm),
        read back to the host in one transfer."""
        names = sorted(self.sums)  # every rank has the same names; sum them in the same order
        device = next((v.device for v in self.sums.values() if isinstance(v, Tensor)), torch.device("cpu"))
        sums = [self.sums[name] for name in names]
        sums = [
            v if isinstance(v, Tensor) else torch.full((), v, dtype=torch.float64, device=device)
            for v in sums
        ]
        summed = dp.sum(torch.stack(sums))
        same = same or {}
        values = torch.cat([summed, *(v.detach().to(summed).reshape(1) for v in same.values())])
        return dict(zip([*names, *same], values.tolist()))


class MetricAccumulator:
    """The means over one update()'s mini-batches of their metrics."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.totals[name] += value
            self.counts[name] += 1

    def means(self) -> dict[str, float]:
        return {name: self.totals[name] / self.counts[name] for name in self.totals}


# ------------------------------------------------------------------------------------------ the base


class TrainedModel:
    """A model with its AdamW and LR schedule, and the update loop both trainable roles share.

    A role (Policy, Critic) names its metric prefix and supplies `check_update_inputs` and
    `train_mini_batch` (forward and backward of each micro-batch, returning the mini-batch's metric
    sums, still on the device);
    `update` does the rest. Its whole state is the model, optimizer and scheduler (what checkpoints save).
    """

    metric_prefix: ClassVar[str]

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimizerSettings,
        update: UpdateSettings,
        *,
        autocast_dtype: torch.dtype | None = None,
        dp: DataParallel = SINGLE_PROCESS,
    ) -> None:
        """dp: the data-parallel ranks it trains with (trainer/parallel/distributed.py); one by default."""
        self.model = model
        self.optim = optim
        self.update_settings = update
        self.autocast_dtype = autocast_dtype
        self.dp = dp
        self.optimizer, self.scheduler = build_optimizer(model, optim)

    @property
    def device(self) -> torch.device:
        return compute_device(self.model)

    def autocast(self):
        return autocast(self.device, self.autocast_dtype)

    def micro_batches(self, batch: TrainBatch, size: MicroBatchSize | None = None) -> Iterator[TrainBatch]:
        size = size or self.update_settings.micro
        return micro_batches(batch, size, self.device, self.dp, shared_prompts=shares_prompts(self.model))

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """ppo_epochs passes over the batch's mini-batches, an optimizer step each; one LR-schedule step.

        Returns the means over mini-batches of the role's metrics, with {prefix}/grad_norm and
        {prefix}/lr (the LR these steps used), as verl names them.
        """
        self.check_update_inputs(batch)
        settings, prefix = self.update_settings, self.metric_prefix
        lr = self.scheduler.get_last_lr()[0]
        self.model.train()
        metrics, steps, skipped = MetricAccumulator(), 0, 0
        for _ in range(settings.ppo_epochs):
            for mini_batch in batch.split(settings.mini_batch_size):
                sums = self.train_mini_batch(mini_batch)
                grad_norm = clip_and_step(self.model, self.optimizer, self.optim.grad_clip)
                # the update's one wait for the device, with the clip and the step already queued
                values = sums.result(self.dp, same={f"{prefix}/grad_norm": grad_norm})
                steps, skipped = steps + 1, skipped + (not math.isfinite(values[f"{prefix}/grad_norm"]))
                metrics.add(values)
        self.scheduler.step()
        if skipped:  # the grad_norm metric reads nan or inf; said here too, as verl's actor says it
            log.warning(
                "%s: %d of %d optimizer steps skipped for a non-finite grad norm", prefix, skipped, steps
            )
        return {**metrics.means(), f"{prefix}/lr": lr}

    def check_update_inputs(self, batch: TrainBatch) -> None:
        raise NotImplementedError

    def train_mini_batch(self, mini_batch: TrainBatch) -> MiniBatchMetrics:
        raise NotImplementedError
