"""Data parallelism for the workers: the process group, sums across ranks, and rows balanced by tokens.

A role (policy, reference, critic) runs as W ranks, each holding 1/W of every parameter (FSDP2) and
1/W of every batch. Two rules make W ranks give the same update as one process on the whole batch:

1. Every mini-batch is split across the ranks, never the batch into per-rank mini-batches: the
   optimizer step k of every rank sees rank r's share of the same global mini-batch k that a single
   process would use (`shard_rows`).
2. Loss denominators (tokens, sequences) are summed over ranks before the loss is formed, and the
   gradients are summed, not averaged, across ranks (trainer/parallel/fsdp.py sets FSDP's divide factor to 1):
   rank r's loss is its part of the global sum, so the summed gradients equal the global gradient.

Rows are dealt to ranks balanced by tokens (verl's `trainer.balance_batch`): every rank gets the same
number of rows, because FSDP ranks must run the same number of forward and backward passes (each pass
gathers parameters collectively), and the rows are chosen so that token counts are as even as a
greedy longest-first deal makes them. Where a role shares prompts (`model.share_prompts`), GRPO's groups
(one prompt's n consecutive rows) are dealt whole, so each rank still runs each of its prompts once.

`DataParallel` is what a worker asks of the group it belongs to; `SINGLE_PROCESS` is the trivial one,
so the single-process trainer runs the very same code.

CPU: gloo. GPU: NCCL, with NVLink multicast (NVLS) off: `NCCL_ENV` must reach every worker process.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# NVLink SHARP / multicast can take a shared host's GPUs out of service; never let NCCL or torch use it.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the ranks of one role, and sums over them.

    `sum` is a collective: every rank must call it the same number of times, in the same order.
    """

    rank: int = 0
    world_size: int = 1
    group: object | None = None  # the torch.distributed process group; None with one rank

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def sum(self, values: Tensor) -> Tensor:
        """Element-wise sum over the ranks of a small float64 tensor: a new tensor, on the device the
        collective ran on (no wait for it here; reading it back, `.tolist()`, waits)."""
        total = values.detach().to(torch.float64).clone()
        if self.is_distributed:
            device = _collective_device()
            total = total.to(device)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total

    def sum_floats(self, *values: float) -> list[float]:
        return self.sum(torch.tensor(values, dtype=torch.float64)).tolist()

    def max_int(self, value: int) -> int:
        """The largest `value` over the ranks (a collective, as `sum`)."""
        if not self.is_distributed:
            return value
        top = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        return int(top.item())


SINGLE_PROCESS = DataParallel()


def _collective_device() -> torch.device:
    # NCCL reduces only CUDA tensors; gloo only CPU ones.
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_data_parallel(
    *, rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device
) -> DataParallel:
    """Join (or form) the role's process group, even of one rank: FSDP2 shards over a device mesh."""
    if device.type == "cuda":
        os.environ.update(NCCL_ENV)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    return DataParallel(rank=rank, world_size=world_size, group=dist.group.WORLD)


def local_data_parallel(device: torch.device) -> DataParallel:
    """A process group of one in this process (formed at first use, then shared by every role of the
    run and by later runs in the same process): FSDP2 shards over a device mesh even of one rank."""
    if not dist.is_initialized():
        if device.type == "cuda":
            os.environ.update(NCCL_ENV)
            torch.cuda.set_device(device)
        dist.init_process_group(
            # gloo for CPU tensors, NCCL for CUDA ones: one group serves CPU and GPU runs in one process
            backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=PROCESS_GROUP_TIMEOUT,
        )
    return DataParallel(rank=0, world_size=1, group=dist.group.WORLD)


def free_port() -> int:
    """A TCP port free on this host now (rank 0 picks it, the others connect to it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


# ------------------------------------------------------------------------------ balancing rows


def balanced_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices 0..len-1 dealt into `parts` groups of equal size, balancing the sum of weights.

    Greedy longest-first: the heaviest remaining row goes to the lightest group that still has room.
    Each group's indices come back in ascending order. len(weights) must divide by `parts`.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(weights) % parts:
        raise ValueError(f"{len(weights)} rows do not split evenly over {parts} ranks")
    capacity = len(weights) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_groups = [g for g in range(parts) if len(groups[g]) < capacity]
        lightest = min(open_groups, key=lambda g: (loads[g], g))
        groups[lightest].append(index)
        loads[lightest] += weights[index]
    return [sorted(group) for group in groups]


def contiguous_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices 0..len-1 in `parts` consecutive runs of equal size (trainer.balance_batch=false; shard_rows
    has checked that they split evenly)."""
    size = len(weights) // parts
    return [list(range(rank * size, (rank + 1) * size)) for rank in range(parts)]


def shard_rows(
    weights: Sequence[int],
    parts: int,
    chunk: int | None = None,
    *,
    balance: bool = True,
    groups: Sequence[int] | None = None,
) -> list[list[int]]:
    """Row indices for each rank: every consecutive `chunk` of rows (a mini-batch) is balanced on its own.

    Rank r's list is its share of chunk 0, then of chunk 1, ...: split by chunk // parts, rank r's
    k-th piece belongs to global mini-batch k. The last chunk may be shorter (as verl allows), but
    every chunk must split evenly over the ranks. chunk None: the whole batch is one chunk.
    groups (a label a row, balance on): a chunk whose rows form runs of one label, all of one size and
    as many as a multiple of `parts`, is dealt a run at a time (`whole_runs`); other chunks row by row.
    """
    chunk = chunk or len(weights)
    shards: list[list[int]] = [[] for _ in range(parts)]
    for start in range(0, len(weights), chunk):
        rows = len(weights[start : start + chunk])
        if rows % parts:
            raise ValueError(
                f"a mini-batch of {rows} sequences does not split evenly over {parts} data-parallel ranks"
            )
        local = weights[start : start + chunk]
        runs = whole_runs(groups[start : start + chunk], parts) if balance and groups is not None else None
        if runs is not None:
            dealt = balanced_partition([sum(local[i] for i in run) for run in runs], parts)
            partition = [[i for r in deal for i in runs[r]] for deal in dealt]
        else:
            partition = (balanced_partition if balance else contiguous_partition)(local, parts)
        for rank, indices in enumerate(partition):
            shards[rank].extend(start + i for i in indices)
    return shards


def whole_runs(labels: Sequence[int], parts: int) -> list[range] | None:
    """The runs of consecutive equal labels, if they are all of one size and their count divides by
    `parts` (every rank then gets as many rows); else None."""
    starts = [i for i in range(len(labels)) if i == 0 or labels[i] != labels[i - 1]]
    runs = [range(a, b) for a, b in zip(starts, [*starts[1:], len(labels)])]
    if not runs or len(runs) % parts or len({len(run) for run in runs}) != 1:
        return None
    return runs


@dataclass(frozen=True)
class Scatter:
    """Which rows of a batch went to which rank, to put per-row results back in the batch's order."""

    shards: tuple[tuple[int, ...], ...]

    @classmethod
    def plan(
        cls,
        token_counts: Sequence[int],
        parts: int,
        chunk: int | None = None,
        *,
        balance: bool = True,
        groups: Sequence[int] | None = None,
    ) -> Scatter:
        shards = shard_rows(token_counts, parts, chunk, balance=balance, groups=groups)
        return cls(tuple(tuple(rows) for rows in shards))

    def gather_rows(self, per_rank: Sequence[Tensor], width: int | None = None) -> Tensor:
        """Per-rank [b_r, T_r] results -> [B, width] in the original row order (zero-padded columns)."""
        width = width or max(part.shape[1] for part in per_rank)
        rows = sum(len(s) for s in self.shards)
        first = per_rank[0]
        out = first.new_zeros((rows, width, *first.shape[2:]))
        for indices, part in zip(self.shards, per_rank):
            out[torch.tensor(indices, dtype=torch.long), : part.shape[1]] = part
        return out
