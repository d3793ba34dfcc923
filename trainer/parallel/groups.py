"""Role groups: the ranks of one role, called by the driver like a single worker, at every scale.

    driver (the fit loop)                      ranks: one in this process (LocalRanks), or one Ray
    run.policy.update(batch)  ── scatter ──>   actor per GPU (RayRanks), each holding a rank object
                              <── metrics ──   (trainer/parallel/ranks.py): FSDP2 collectives, loss
                                               sums all-reduced

A single CPU or GPU is a group of one local rank, never a separate code path: the same rank objects,
FSDP2 over a world of one, the same rollout replicas. `PolicyGroup`, `ReferenceGroup` and `CriticGroup`
give the roles' methods; the rows each rank gets (balanced by tokens, split per mini-batch:
trainer/parallel/distributed.py), putting per-row results back in order, and the Ray object refs stay
in here, so the loop does not change shape between one process and many nodes. Where the ranks live,
and how a failed one stops its role: trainer/parallel/placement.py.

Rollout: every policy rank's engine is a replica of the driver's RolloutManager (`PolicyGroup.replicas`):
the local rank's replica itself, or a `RankReplica` that forwards the manager's calls to a Ray rank.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.batch import TrainBatch
from trainer.checkpoint import ALL_CONTENTS
from trainer.config import Config
from trainer.model import Precision
from trainer.parallel.distributed import Scatter
from trainer.parallel.placement import LocalRanks, Ranks, RayRanks, ResourcePool, connect_ray

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ the driver's handle


class RoleGroup:
    """The ranks of one role. Subclasses give the role's methods; this class moves rows."""

    role_name = "role"

    def __init__(self, ranks: Ranks, *, balance: bool = True, whole_groups: bool = False) -> None:
        """balance: deal rows to ranks by tokens (trainer.balance_batch), else in consecutive runs.
        whole_groups (balanced, a role that shares prompts): a prompt's group goes to one rank."""
        self.ranks, self.balance, self.whole_groups = ranks, balance, whole_groups
        self.world_size = ranks.world_size

    @property
    def remote(self) -> bool:
        return self.ranks.remote

    def call_all(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs) -> list:
        return self.ranks.call_all(method, per_rank_args, **kwargs)

    def start_profile(self) -> None:
        self.ranks.start_profile()

    def stop_profile(self, folder: str, name: str) -> None:
        self.ranks.stop_profile(folder, name)

    def node_ids(self) -> list[str]:
        return self.ranks.node_ids()

    def shutdown(self) -> None:
        self.ranks.shutdown()

    def scatter(self, batch: TrainBatch, chunk: int | None = None) -> tuple[Scatter, list[tuple[TrainBatch]]]:
        """Rows for each rank, balanced by tokens within every `chunk` (mini-batch) of the batch."""
        tokens = (batch.prompt_lengths + batch.response_lengths).tolist()
        groups = batch.group_ids.tolist() if self.whole_groups and self.world_size > 1 else None
        plan = Scatter.plan(tokens, self.world_size, chunk, balance=self.balance, groups=groups)
        return plan, [(batch.select(list(rows)),) for rows in plan.shards]


MEMORY_METRICS = ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")


def _same_metrics_and_peak_memory(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Every rank reports the same all-reduced training metrics; peak memory is the largest rank's."""
    metrics = dict(per_rank[0])
    for name in MEMORY_METRICS:
        if name in metrics:
            metrics[name] = max(rank[name] for rank in per_rank)
    return metrics


class ReferenceGroup(RoleGroup):
    role_name = "reference"

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        plan, shards = self.scatter(batch)
        parts = self.call_all("compute_logprobs", shards)
        return plan.gather_rows(parts, batch.response_width)


class _TrainedGroup(RoleGroup):
    """A role with an optimizer: updated a global mini-batch at a time, saved and loaded rank by rank."""

    def __init__(self, ranks: Ranks, *, mini_batch_size: int, **kwargs) -> None:
        super().__init__(ranks, **kwargs)
        self.mini_batch_size = mini_batch_size

    def update(self, batch: TrainBatch) -> dict[str, float]:
        _, shards = self.scatter(batch, self.mini_batch_size)
        return _same_metrics_and_peak_memory(self.call_all("update", shards))

    def save(self, directory: str, contents: Sequence[str] = ALL_CONTENTS) -> None:
        self.call_all("save", [(directory, list(contents))] * self.world_size)

    def load(self, directory: str, contents: Sequence[str] = ALL_CONTENTS) -> None:
        self.call_all("load", [(directory, list(contents))] * self.world_size)


class CriticGroup(_TrainedGroup):
    role_name = "critic"

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        plan, shards = self.scatter(batch)
        return plan.gather_rows(self.call_all("compute_values", shards), batch.response_width)


class PolicyGroup(_TrainedGroup):
    role_name = "policy"

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False):
        from trainer.workers.logprobs import ResponseLogprobs

        plan, shards = self.scatter(batch)
        parts = self.call_all("compute_logprobs", shards, with_entropy=with_entropy)
        width = batch.response_width
        return ResponseLogprobs(
            logprobs=plan.gather_rows([p.logprobs for p in parts], width),
            entropy=plan.gather_rows([p.entropy for p in parts], width) if with_entropy else None,
        )

    def profile(self):
        return self.call_all("profile")[0]

    def replicas(self) -> list:
        """Every rank's colocated engine as a rollout replica, with its capacity (sequences at once)."""
        replicas = self.ranks.replicas()
        if self.remote:
            for replica, capacity in zip(replicas, self.call_all("replica_capacity")):
                replica.capacity = capacity
        return replicas

    def sync_weights(self) -> float:
        """Every rank's engine takes the current policy weights; returns the slowest rank's seconds."""
        return max(self.call_all("sync_weights"))

    def save_hf_weights(self, folder: str) -> None:
        """Rank 0 writes the current policy as a transformers checkpoint into `folder` (rollout servers)."""
        self.call_all("save_hf_weights", [(folder,)] * self.world_size)


class GroupWeights:
    """The policy group's current weights in the form RolloutManager.load_weights takes a model: it calls
    save_pretrained(folder), and rank 0 writes the checkpoint there (the folder must be reachable from
    rank 0's node: one node, or a shared file system)."""

    def __init__(self, policy: PolicyGroup) -> None:
        self.policy = policy

    def save_pretrained(self, folder, safe_serialization: bool = True) -> None:
        self.policy.save_hf_weights(str(folder))


# ------------------------------------------------------------------------------ building a run's groups


@dataclass
class Groups:
    """A run's role groups; the reference and critic exist when the config asks for them."""

    policy: PolicyGroup
    reference: ReferenceGroup | None
    critic: CriticGroup | None
    pools: list[ResourcePool]

    def all(self) -> list[RoleGroup]:
        return [g for g in (self.policy, self.reference, self.critic) if g is not None]

    def shutdown(self) -> None:
        for group in self.all():
            group.shutdown()
        for pool in self.pools:
            pool.release()


DRIVER_THREADS = 4


def build_groups(cfg: Config, device: torch.device, precision: Precision, steps: int) -> Groups:
    """Every role's ranks, each loading its model: one local rank in this process, or (cfg.uses_ray:
    trainer.use_ray, or more than one GPU) Ray actors over trainer.nnodes x trainer.n_gpus_per_node."""
    from trainer.parallel import settings as rank_settings
    from trainer.parallel.ranks import CriticRank, PolicyRank, ReferenceRank

    trainer = cfg.trainer
    policy = rank_settings.policy_rank_settings(cfg, precision, steps)
    builds = {"policy": functools.partial(PolicyRank, policy)}
    if cfg.use_reference:
        builds["reference"] = functools.partial(
            ReferenceRank, rank_settings.reference_rank_settings(cfg, precision)
        )
    critic = rank_settings.critic_rank_settings(cfg, precision, steps) if cfg.use_critic else None
    if critic is not None:
        builds["critic"] = functools.partial(CriticRank, critic)
    if cfg.uses_ray:
        # The driver only moves rows between ranks: a few torch threads do. At one a core (64 on a 4-GPU
        # host whose cores the ranks and Ray share) its row copies ran 10-40x slower than on 2 threads here,
        # up to 0.45 s a copy at 4 GPUs (py-spy), while every rank waited.
        torch.set_num_threads(min(DRIVER_THREADS, torch.get_num_threads()))
        how = connect_ray(num_cpus=max(cfg.world_size, os.cpu_count() or 1) if device.type == "cpu" else None)
        separate = trainer.role_pools == "separate"
        pools = [
            ResourcePool(trainer.nnodes, trainer.n_gpus_per_node, use_gpu=device.type == "cuda")
            for _ in range(len(builds) if separate else 1)
        ]
        ranks = {}
        for i, (role, build) in enumerate(builds.items()):  # colocated: the policy's processes host all
            host = None if separate or i == 0 else ranks["policy"]
            ranks[role] = RayRanks(
                pools[i if separate else 0], build, role=role, seed=trainer.seed, host=host
            )
    else:
        how, pools = "one rank in this process", []
        ranks = {
            role: LocalRanks(build, role=role, device=device, seed=trainer.seed)
            for role, build in builds.items()
        }
    # rows balanced by tokens; a role that shares prompts gets each prompt's group whole (the reference
    # runs the actor's model settings)
    dealt = {"balance": trainer.balance_batch, "whole_groups": policy.model.share_prompts}
    groups = Groups(
        policy=PolicyGroup(ranks["policy"], mini_batch_size=policy.update.mini_batch_size, **dealt),
        reference=ReferenceGroup(ranks["reference"], **dealt) if "reference" in ranks else None,
        critic=CriticGroup(
            ranks["critic"],
            mini_batch_size=critic.update.mini_batch_size,
            balance=trainer.balance_batch,
            whole_groups=critic.model.share_prompts,
        )
        if critic is not None
        else None,
        pools=pools,
    )
    log.info(
        "%s; %d rank(s) per role on %d node(s), roles %s",
        how,
        groups.policy.world_size,
        len(set(groups.policy.node_ids())),
        "on separate GPUs" if trainer.role_pools == "separate" else "colocated",
    )
    return groups
