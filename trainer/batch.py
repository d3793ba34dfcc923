"""TrainBatch: the typed record that carries one step's sequences through the trainer's stages.

Layout, B sequences (prompts x n samples), P = longest prompt, T = longest response:

    input_ids       [B, P+T]  pad pad p0 p1 p2 | r0 r1 r2 pad     (prompt left-padded, response right-padded)
    attention_mask  [B, P+T]    0   0  1  1  1 |  1  1  1   0
    position_ids    [B, P+T]    0   0  0  1  2 |  3  4  5   5     (real tokens only, as the engine used)
    response_mask   [B, T]                     |  1  1  1   0     (loss mask: 0 on padding / tool output)

The response starts at column P for every row, so a response-aligned tensor [B, T] (logprobs, values,
advantages, ...) lines up with `input_ids[:, P:]`. Stages fill the optional fields as the step goes
(old_logprobs, ref_logprobs, values, token_scores, advantages, returns), always as new records via
`with_fields`, never by mutating a batch another stage holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trainer.rollout.base import Rollout, concatenated


@dataclass(frozen=True)
class TrainBatch:
    input_ids: Tensor  # [B, P+T] int64
    attention_mask: Tensor  # [B, P+T] int64
    position_ids: Tensor  # [B, P+T] int64
    response_mask: Tensor  # [B, T] float32
    prompt_lengths: Tensor  # [B] int64, real prompt tokens
    response_lengths: Tensor  # [B] int64, real response tokens
    group_ids: Tensor  # [B] int64, samples of the same prompt share one (GRPO groups)
    rollout_logprobs: Tensor | None = None  # [B, T] the engine's sampled-token logprobs
    old_logprobs: Tensor | None = None  # [B, T] the policy's, before this step's update
    ref_logprobs: Tensor | None = None  # [B, T]
    values: Tensor | None = None  # [B, T] the critic's, before its update
    token_scores: Tensor | None = None  # [B, T] reward-model scores placed on tokens
    advantages: Tensor | None = None  # [B, T]
    returns: Tensor | None = None  # [B, T]
    data_sources: tuple[str, ...] | None = None  # [B]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        """T: the padded response length."""
        return self.response_mask.shape[1]

    @property
    def prompt_width(self) -> int:
        """P: the padded prompt length; responses start at this column."""
        return self.input_ids.shape[1] - self.response_width

    @property
    def responses(self) -> Tensor:
        return self.input_ids[:, self.prompt_width :]

    @classmethod
    def from_rollouts(
        cls, rollouts: Sequence[Rollout], pad_id: int, *, data_sources: Sequence[str] | None = None
    ) -> TrainBatch:
        """Pad rollouts into a batch, grouped by `Rollout.prompt_index` (so rollouts merged from several
        generate() calls, DAPO refills, must be re-indexed first). data_sources: one per prompt, looked
        up by prompt_index."""
        if not rollouts:
            raise ValueError("no rollouts to batch")
        for index, r in enumerate(rollouts):
            if not len(r.response_ids) == len(r.logprobs) == len(r.loss_mask):
                raise ValueError(f"rollout {index}: response_ids, logprobs and loss_mask differ in length")
        prompt_width = max(len(r.prompt_ids) for r in rollouts)
        width = max(max(len(r.response_ids) for r in rollouts), 1)
        batch_size = len(rollouts)
        input_ids = torch.full((batch_size, prompt_width + width), pad_id, dtype=torch.long)
        response_mask = torch.zeros(batch_size, width, dtype=torch.float32)
        rollout_logprobs = torch.zeros(batch_size, width, dtype=torch.float32)
        # Every row's values at once: each field's values end to end, written through a mask of where
        # they go (a mask's True cells run in row-major order, as the values do). One tensor per field,
        # not three a row (2,048 rows took 0.23 s); masks, not (row, column) index lists (2.3x faster).
        prompt_lengths = torch.tensor([len(r.prompt_ids) for r in rollouts], dtype=torch.long)
        response_lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.long)
        in_prompt = torch.arange(prompt_width) >= (prompt_width - prompt_lengths)[:, None]  # left-padded
        in_response = torch.arange(width) < response_lengths[:, None]
        input_ids[:, :prompt_width][in_prompt] = _flat([r.prompt_ids for r in rollouts], np.int64)
        input_ids[:, prompt_width:][in_response] = _flat([r.response_ids for r in rollouts], np.int64)
        attention_mask = torch.cat([in_prompt, in_response], dim=1).long()
        response_mask[in_response] = _flat([r.loss_mask for r in rollouts], np.float32)
        rollout_logprobs[in_response] = _flat([r.logprobs for r in rollouts], np.float32)
        sources = None
        if data_sources is not None:
            sources = tuple(data_sources[r.prompt_index] for r in rollouts)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(dim=-1) - 1).clamp(min=0),
            response_mask=response_mask,
            prompt_lengths=prompt_lengths,
            response_lengths=response_lengths,
            group_ids=torch.tensor([r.prompt_index for r in rollouts], dtype=torch.long),
            rollout_logprobs=rollout_logprobs,
            data_sources=sources,
        )

    def with_fields(self, **fields) -> TrainBatch:
        """A copy with some fields set (e.g. `batch.with_fields(advantages=adv)`)."""
        return dataclasses.replace(self, **fields)

    def select(self, indices: Sequence[int] | Tensor) -> TrainBatch:
        """The rows at `indices`, in that order, with every per-sequence field."""
        index = torch.as_tensor(indices, dtype=torch.long)
        picked = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor):
                picked[field.name] = value[index.to(value.device)]
            elif isinstance(value, tuple):
                picked[field.name] = tuple(value[i] for i in index.tolist())
        return dataclasses.replace(self, **picked)

    def split(self, size: int) -> list[TrainBatch]:
        """Consecutive chunks of `size` rows (the last one shorter if B is not a multiple)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [
            self.select(range(start, min(start + size, len(self)))) for start in range(0, len(self), size)
        ]

    def trimmed(self) -> TrainBatch:
        """Drop the columns that are padding in every row (prompt's left, response's right).

        Micro-batches of short sequences then cost only their own length. Position ids and masks of the
        real tokens are unchanged, so every forward gives the same numbers as on the full batch.
        """
        prompt_pad = int(self.prompt_width - self.prompt_lengths.max())
        response_keep = max(int(self.response_lengths.max()), 1)
        response_pad = self.response_width - response_keep
        if prompt_pad == 0 and response_pad == 0:
            return self
        end = self.input_ids.shape[1] - response_pad
        trimmed = {
            name: getattr(self, name)[:, prompt_pad:end]
            for name in ("input_ids", "attention_mask", "position_ids")
        }
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor) and value.dim() == 2 and field.name not in trimmed:
                trimmed[field.name] = value[:, :response_keep]  # the response-aligned [B, T] fields
        return dataclasses.replace(self, **trimmed)

    def to(self, device: torch.device | str) -> TrainBatch:
        """The batch on `device`, except the lengths: they stay on the host, where micro-batches are
        trimmed and packed (trainer/packing.py) from them without waiting for the device."""
        moved = {
            f.name: to_device(getattr(self, f.name), device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor) and f.name not in HOST_FIELDS
        }
        return dataclasses.replace(self, **moved)


# read on the host only: the packed layout is planned from them (group ids: pack_shared's runs)
HOST_FIELDS = ("prompt_lengths", "response_lengths", "group_ids")


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """`tensor` on `device`. From the host to a GPU the copy goes through pinned memory without blocking:
    a pageable copy waits for all the work already queued on the device (a sync per tensor). A view
    (a trimmed micro-batch's columns) is made contiguous first: pinned but strided, the copy would make
    its own contiguous copy in pageable memory and wait after all (74 ms a micro-batch in a profile)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.contiguous().pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _flat(rows: list[list], dtype: np.dtype) -> Tensor:
    return torch.from_numpy(concatenated(rows, dtype))
