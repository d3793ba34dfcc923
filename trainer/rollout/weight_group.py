"""The rollout server's side of SGLang's /init_weights_update_group and /update_weights_from_distributed:
its ranks (rank_offset + tp_rank) join a trainer's group, where rank 0 broadcasts named tensors.

Built as SGLang 0.5.23 builds it (srt/utils/common.py `init_custom_process_group`, used by
model_executor/model_runner_components/weight_updater.py): a rendezvous at tcp://master_address:
master_port, whose store is prefixed with the group name, handed to torch's process-group constructor
as a group apart from the default one (a trainer's own torch.distributed world is left alone). Then
for each (name, dtype, shape) in the request's order, one broadcast from rank 0. The same key layout
as SGLang's is what lets SGLang's trainers (slime, verl) feed our server; our own trainer syncs its
replicas otherwise, and tests/trainer/test_sglang_contract.py holds the rank-0 sender that checks it.
gloo works on CPU (our tests, the CPU server); nccl is what GPU deployments use.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default
TIMEOUT = datetime.timedelta(minutes=10)


def init_weight_group(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
) -> dist.ProcessGroup:
    """Join the group (blocks until all world_size ranks have joined; rank 0 hosts the store)."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=TIMEOUT)
    )
    store.set_timeout(TIMEOUT)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=TIMEOUT,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # collectives look the ranks up here
    return group


def receive_weights(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """A server rank's side: empty tensors of the announced dtypes and shapes (the request model checked
    that the three align), filled by rank 0."""
    tensors = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensors[name] = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors.values()]
    for work in works:
        work.wait()
    return tensors


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' (SGLang's clients send str(dtype) with the prefix removed)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
