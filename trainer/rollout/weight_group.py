"""The weight-update process group of SGLang's /init_weights_update_group and
/update_weights_from_distributed, both sides: the trainer (rank 0) broadcasts named tensors, each rollout
server's ranks (rank_offset + tp_rank) receive them.

Built as SGLang 0.5.23 builds it (srt/utils/common.py `init_custom_process_group`, used by
model_executor/model_runner_components/weight_updater.py): a rendezvous at tcp://master_address:
master_port, whose store is prefixed with the group name, handed to torch's process-group constructor
as a group apart from the default one (a trainer's own torch.distributed world is left alone). Then
for each (name, dtype, shape) in the request's order, one broadcast from rank 0. The same key layout
on both sides is what lets our trainer feed a real SGLang server and SGLang's trainers feed ours.
gloo works on CPU (our tests, the CPU server); nccl is what GPU deployments use.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence

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
    timeout: datetime.timedelta = TIMEOUT,
) -> dist.ProcessGroup:
    """Join the group (blocks until all world_size ranks have joined; rank 0 hosts the store)."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

    if not group_name:
        raise ValueError("group_name must not be empty")
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # collectives look the ranks up here
    return group


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def broadcast_weights(group: dist.ProcessGroup, named_tensors: Mapping[str, Tensor]) -> None:
    """Rank 0's side: every tensor, in the order of the metadata sent to the servers."""
    for tensor in named_tensors.values():
        dist.broadcast(tensor.detach().contiguous(), src=0, group=group)


def receive_weights(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """A server rank's side: empty tensors of the announced dtypes and shapes, filled by rank 0."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightBroadcaster:
    """The trainer's end of SGLang's distributed weight update: rank 0 of one group with every rank of
    every rollout server (server i's ranks are rank_offset_i + tp_rank, tp sizes read from
    /get_server_info). As slime and verl do it: each HTTP call and the trainer's own part of it run
    together, since neither returns before the other side has joined in."""

    def __init__(
        self,
        replicas: Sequence,
        *,
        master_address: str,
        master_port: int,
        backend: str = "nccl",
        group_name: str = DEFAULT_GROUP_NAME,
    ) -> None:
        """replicas: trainer.rollout.client.HttpReplica (or anything with the same three methods)."""
        self.replicas = list(replicas)
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.group_name = backend, group_name
        self.group: dist.ProcessGroup | None = None

    async def connect(self) -> None:
        import asyncio

        sizes = [int((await r.server_info()).get("tp_size") or 1) for r in self.replicas]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world_size = 1 + sum(sizes)
        joins = [
            r.init_weights_update_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=offset,
                world_size=world_size,
                group_name=self.group_name,
                backend=self.backend,
            )
            for r, offset in zip(self.replicas, offsets)
        ]
        own = asyncio.to_thread(
            init_weight_group,
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=world_size,
            rank=0,
            group_name=self.group_name,
            backend=self.backend,
        )
        results = await asyncio.gather(own, *joins)
        self.group = results[0]

    async def send(self, named_tensors: Mapping[str, Tensor], *, weight_version: str | None = None) -> None:
        """Every tensor to every server; returns once all of them loaded it."""
        import asyncio

        if self.group is None:
            raise RuntimeError("connect() first")
        tensors = {name: t.detach() for name, t in named_tensors.items()}
        metadata = {
            "names": list(tensors),
            "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": self.group_name,
        }
        updates = [
            r.update_weights_from_distributed(metadata, weight_version=weight_version) for r in self.replicas
        ]
        await asyncio.gather(asyncio.to_thread(broadcast_weights, self.group, tensors), *updates)

    def close(self) -> None:
        if self.group is not None:
            destroy_weight_group(self.group)
            self.group = None
