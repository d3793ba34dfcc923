"""Role groups: one Ray actor per GPU for each role, called by the driver like a single worker.

    driver (the fit loop)                      Ray actors, one per GPU (placement groups, node by node)
    run.policy.update(batch)  ── scatter ──>   rank 0: PolicyRank.update(shard 0)  ┐ FSDP2 collectives,
                              <── metrics ──   rank 1: PolicyRank.update(shard 1)  ┘ loss sums all-reduced

`PolicyGroup`, `ReferenceGroup` and `CriticGroup` have the methods of the single-process workers;
the rows each rank gets (balanced by tokens, split per mini-batch: trainer/distributed.py), putting
per-row results back in order, and the Ray object refs all stay in here, so the loop does not change
shape between one process and many GPUs.

Placement: `ResourcePool` reserves one bundle per GPU, as one placement group per node packed onto
that node, so ranks 0..k-1 share node 0, and so on. Roles are colocated by default: every role's
rank r takes a fraction of bundle r (the policy, its rollout engine, the reference and the critic
share each GPU, as verl's hybrid engine does); giving roles separate pools puts them on separate GPUs.

Failure: a rank that dies or raises leaves its peers blocked in a collective. The group waits for its
ranks one at a time and stops at the first failure: it kills the whole group (so nothing hangs) and
raises `WorkerGroupError` naming the role, the rank and the call; the loop adds the last checkpoint.
Across nodes the message also names the rank's node by IP and hostname, and says when that node left
the Ray cluster (`rank_failure`): a lost node is what a multi-node user needs to see first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.batch import TrainBatch
from trainer.distributed import NCCL_ENV, Scatter, free_port, init_data_parallel
from trainer.profiling import profiler_activities, write_profile

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 300.0
# After a rank raised an ordinary error, how long to wait for a peer whose process or node went away
# (a lost node makes its peers' collectives fail too, often first): that peer is the cause to report.
ROOT_CAUSE_WAIT_S = 5.0


class WorkerGroupError(RuntimeError):
    """A rank of a role group died or failed; the group has been shut down."""


@dataclass(frozen=True)
class PolicyProfile:
    """What MFU needs to know of the policy: its size, its epochs and the GPU it trains on (None: CPU)."""

    num_params: int
    num_layers: int
    hidden_size: int
    ppo_epochs: int
    device_name: str | None
    in_process: bool  # trained by this process (whose CUDA memory counters are then the ones to read)

    @classmethod
    def of(cls, model: torch.nn.Module, ppo_epochs: int, *, in_process: bool) -> PolicyProfile:
        from trainer.fsdp import compute_device

        on_gpu = compute_device(model).type == "cuda"
        return cls(
            num_params=sum(p.numel() for p in model.parameters()),  # DTensors count their global size
            num_layers=model.config.num_hidden_layers,
            hidden_size=model.config.hidden_size,
            ppo_epochs=ppo_epochs,
            device_name=torch.cuda.get_device_name() if on_gpu else None,
            in_process=in_process,
        )


# ------------------------------------------------------------------------------ the Ray cluster


def connect_ray(address: str | None = None, *, num_cpus: int | None = None) -> str:
    """Join the Ray cluster at `address` (or $RAY_ADDRESS, or one started by `ray start` on this node),
    or start a local one when there is none. Returns how it connected, for the log.

    address "local" always starts a fresh local cluster (tests); `num_cpus` sizes it.
    """
    import ray

    if ray.is_initialized():
        return "already connected"
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": {**NCCL_ENV, **_python_path()}}
    if address is None:
        try:  # a cluster started with `ray start` on this node (the job group's trainer task)
            ray.init(address="auto", runtime_env=runtime_env, log_to_driver=True)
            return "joined the Ray cluster running on this node"
        except ConnectionError:
            address = "local"
    if address == "local":
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            object_store_memory=_local_object_store_bytes(),
        )
        return "started a local Ray cluster"
    ray.init(address=address, runtime_env=runtime_env)
    return f"joined the Ray cluster at {address}"


def _python_path() -> dict[str, str]:
    # Workers of a local cluster must import this checkout even when it is not installed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _local_object_store_bytes() -> int:
    # Batches are token ids and [B, T] tensors: a small store starts faster and leaves memory to torch.
    return int(os.environ.get("TRAINER_RAY_OBJECT_STORE_BYTES", 512 * 2**20))


@dataclass(frozen=True)
class Slot:
    placement_group: Any
    bundle_index: int


class ResourcePool:
    """`nnodes` x `per_node` bundles of one GPU (or one CPU, without GPUs), a placement group per node.

    Waits up to `timeout_s` for the cluster to have room and says what is missing when it does not.
    """

    def __init__(self, nnodes: int, per_node: int, *, use_gpu: bool, timeout_s: float = PLACEMENT_TIMEOUT_S):
        import ray
        from ray.util.placement_group import placement_group

        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self.use_gpu = use_gpu
        self.groups = [placement_group([bundle] * per_node, strategy="STRICT_PACK") for _ in range(nnodes)]
        ready, _ = ray.wait([group.ready() for group in self.groups], num_returns=nnodes, timeout=timeout_s)
        if len(ready) < nnodes:
            for group in self.groups:
                ray.util.remove_placement_group(group)
            device = "GPU" if use_gpu else "CPU"
            raise WorkerGroupError(
                f"the Ray cluster cannot place {nnodes} node(s) x {per_node} {device}(s) "
                f"(trainer.nnodes x trainer.n_gpus_per_node) within {timeout_s:.0f} s; it has "
                f"{_describe_resources(ray.cluster_resources())}"
            )
        self.slots = [Slot(group, index) for group in self.groups for index in range(per_node)]

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def release(self) -> None:
        import ray

        for group in self.groups:
            ray.util.remove_placement_group(group)


def _describe_resources(resources: dict) -> str:
    nodes = sum(1 for key in resources if key.startswith("node:") and not key.startswith("node:__"))
    return f"{nodes} node(s), {resources.get('GPU', 0):g} GPU(s), {resources.get('CPU', 0):g} CPU(s)"


# ------------------------------------------------------------------------------ one rank's process


class RankActor:
    """The Ray actor of one rank: its device, its process group and the role object built there.

    Plumbing only: what a rank does is the role object's (trainer/workers/ranks.py); `call` forwards.
    """

    def __init__(self, rank: int, world_size: int, use_gpu: bool, seed: int) -> None:
        self.rank, self.world_size, self.use_gpu, self.seed = rank, world_size, use_gpu, seed
        self.role = None
        self.profiler = None

    def node_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, build: Callable, master_addr: str, master_port: int) -> int:
        device = (
            torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")
        )  # Ray set CUDA_VISIBLE_DEVICES
        dp = init_data_parallel(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            device=device,
        )
        torch.manual_seed(self.seed + self.rank)
        self.role = build(dp, device)
        return os.getpid()

    def call(self, method: str, *args, **kwargs):
        return getattr(self.role, method)(*args, **kwargs)

    def start_profile(self) -> None:
        """torch.profiler from now until stop_profile (trainer.profile_steps reaching into the ranks)."""
        from torch.profiler import profile

        self.profiler = profile(activities=profiler_activities())
        self.profiler.__enter__()

    def stop_profile(self, folder: str, name: str) -> None:
        """Stop the profiler; write folder/<name>_rank<R>.txt and .json on this rank's node."""
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        write_profile(profiler, Path(folder), f"{name}_rank{self.rank}")

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


# ------------------------------------------------------------------------------ the driver's handle


class RoleGroup:
    """The ranks of one role. Subclasses give the role's methods; this class moves rows and refs."""

    role_name = "role"

    def __init__(
        self, pool: ResourcePool, build: Callable, *, share: float = 1.0, seed: int = 0, balance: bool = True
    ) -> None:
        """build(dp, device) -> the role object, run in every rank's process. share: the fraction of each
        bundle this role takes (1/k when k roles are colocated on the pool). balance: deal rows to ranks
        by tokens (trainer.balance_batch), else in consecutive runs."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size, self.balance = pool.world_size, balance
        self.failure: str | None = None
        self.rank_nodes: list[str] = []  # each rank's Ray node id, to name a lost node
        remote = ray.remote(RankActor)
        self.actors = [
            remote.options(
                num_cpus=share,
                num_gpus=share if pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
                ),
                runtime_env={"env_vars": dict(NCCL_ENV)},
            ).remote(rank, self.world_size, pool.use_gpu, seed)
            for rank, slot in enumerate(pool.slots)
        ]
        master_addr, master_port = self._wait([self.actors[0].node_address.remote()], "start")[0]
        self.pids = self._wait(
            [actor.setup.remote(build, master_addr, master_port) for actor in self.actors], "setup"
        )
        self.rank_nodes = self.node_ids()

    # -------------------------------------------------------------- calls
    def call_all(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs) -> list:
        """Call `method` on every rank (rank r gets per_rank_args[r]); the results in rank order."""
        if self.failure is not None:
            raise WorkerGroupError(f"the {self.role_name} group was shut down after: {self.failure}")
        per_rank_args = per_rank_args or [()] * self.world_size
        refs = [actor.call.remote(method, *args, **kwargs) for actor, args in zip(self.actors, per_rank_args)]
        return self._wait(refs, method)

    def start_profile(self) -> None:
        self._wait([actor.start_profile.remote() for actor in self.actors], "start_profile")

    def stop_profile(self, folder: str, name: str) -> None:
        self._wait([actor.stop_profile.remote(folder, name) for actor in self.actors], "stop_profile")

    def _wait(self, refs: list, what: str) -> list:
        """ray.get that fails fast: the first rank to fail stops the group instead of leaving peers hung."""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception as exc:  # any failure of a rank ends the group
                rank, reason = rank_failure(rank_of[ready[0]], exc, pending, rank_of, self.rank_nodes)
                self.shutdown()
                who = f"{self.role_name} rank {rank} of {self.world_size}"
                self.failure = f"{who} failed during {what}: {reason}"
                raise WorkerGroupError(self.failure) from exc
        return ray.get(refs)

    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order."""
        return self._wait([actor.node_id.remote() for actor in self.actors], "node_id")

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    # -------------------------------------------------------------- rows
    def scatter(self, batch: TrainBatch, chunk: int | None = None) -> tuple[Scatter, list[tuple[TrainBatch]]]:
        """Rows for each rank, balanced by tokens within every `chunk` (mini-batch) of the batch."""
        tokens = (batch.prompt_lengths + batch.response_lengths).tolist()
        plan = Scatter.plan(tokens, self.world_size, chunk, balance=self.balance)
        return plan, [(batch.select(list(rows)),) for rows in plan.shards]


MEMORY_METRICS = ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")


def _same_metrics_and_peak_memory(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Every rank reports the same all-reduced training metrics; peak memory is the largest rank's."""
    metrics = dict(per_rank[0])
    for name in MEMORY_METRICS:
        if name in metrics:
            metrics[name] = max(rank[name] for rank in per_rank)
    return metrics


def rank_failure(
    rank: int, exc: Exception, pending: list, rank_of: dict, rank_nodes: list[str]
) -> tuple[int, str]:
    """The rank to blame and one line saying why, naming its node when there are several.

    A rank whose process or node went away (a Ray actor error) is the cause; a rank that raised an
    ordinary error may only be the peer of one (gloo: "Connection closed by peer"), so the other ranks
    get ROOT_CAUSE_WAIT_S to fail with an actor error first. How fast a vanished node is noticed is Ray's:
    at once when its connections close, else after the GCS's health checks (start_ray.sh bounds them).
    """
    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError

    if not isinstance(exc, RayActorError) and pending:
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=ROOT_CAUSE_WAIT_S)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as peer_exc:
                rank, exc = rank_of[ref], peer_exc
                break
            except Exception:  # noqa: BLE001 - another ordinary error: the first one stays the cause
                continue
    reason = _first_line(exc).strip()  # Ray indents the cause of a node's death
    if len(set(rank_nodes)) < 2:
        return rank, reason
    node = next((n for n in ray.nodes() if n["NodeID"] == rank_nodes[rank]), None)
    if node is None:
        return rank, reason
    where = f"node {node['NodeManagerAddress']} ({node['NodeManagerHostname']})"
    if not node["Alive"]:
        return rank, f"its {where} left the Ray cluster: {reason}"
    if isinstance(exc, ActorUnavailableError):  # its connections closed: the node or the network is gone
        return rank, f"lost contact with {where}: {reason}"
    if isinstance(exc, RayActorError):
        return rank, f"its process died on {where}: {reason}"
    return rank, f"on {where}: {reason}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    # RayTaskError prints the remote traceback first; its last line is the exception itself
    return lines[-1] if lines else type(exc).__name__


class ReferenceGroup(RoleGroup):
    role_name = "reference"

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        plan, shards = self.scatter(batch)
        parts = self.call_all("compute_logprobs", shards)
        return plan.gather_rows(parts, batch.response_width)


class CriticGroup(RoleGroup):
    role_name = "critic"

    def __init__(self, pool: ResourcePool, build: Callable, *, mini_batch_size: int, **kwargs) -> None:
        super().__init__(pool, build, **kwargs)
        self.mini_batch_size = mini_batch_size

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        plan, shards = self.scatter(batch)
        return plan.gather_rows(self.call_all("compute_values", shards), batch.response_width)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        _, shards = self.scatter(batch, self.mini_batch_size)
        return _same_metrics_and_peak_memory(self.call_all("update", shards))

    def save(self, directory: str) -> None:
        self.call_all("save", [(directory,)] * self.world_size)

    def load(self, directory: str) -> None:
        self.call_all("load", [(directory,)] * self.world_size)


class PolicyGroup(RoleGroup):
    role_name = "policy"

    def __init__(
        self, pool: ResourcePool, build: Callable, *, mini_batch_size: int, ppo_epochs: int, **kwargs
    ) -> None:
        super().__init__(pool, build, **kwargs)
        self.mini_batch_size, self.ppo_epochs = mini_batch_size, ppo_epochs

    def is_on_policy(self, batch_size: int) -> bool:
        return self.ppo_epochs == 1 and self.mini_batch_size >= batch_size

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False):
        from trainer.workers.logprobs import ResponseLogprobs

        plan, shards = self.scatter(batch)
        parts = self.call_all("compute_logprobs", shards, with_entropy=with_entropy)
        width = batch.response_width
        return ResponseLogprobs(
            logprobs=plan.gather_rows([p.logprobs for p in parts], width),
            entropy=plan.gather_rows([p.entropy for p in parts], width) if with_entropy else None,
        )

    def update(self, batch: TrainBatch) -> dict[str, float]:
        _, shards = self.scatter(batch, self.mini_batch_size)
        return _same_metrics_and_peak_memory(self.call_all("update", shards))

    def profile(self) -> PolicyProfile:
        return self.call_all("profile")[0]

    def generate(self, prompt_ids: list[list[int]], sampling) -> list:
        """Each rank's colocated engine samples a contiguous share of the prompts (n samples each)."""
        bounds = [len(prompt_ids) * rank // self.world_size for rank in range(self.world_size + 1)]
        shares = [(prompt_ids[lo:hi], sampling) for lo, hi in zip(bounds[:-1], bounds[1:])]
        rollouts = []
        for lo, part in zip(bounds, self.call_all("generate", shares)):
            rollouts += [dataclasses.replace(r, prompt_index=r.prompt_index + lo) for r in part]
        return rollouts

    def sync_weights(self) -> float:
        """Every rank's engine takes the current policy weights; returns the slowest rank's seconds."""
        return max(self.call_all("sync_weights"))

    def save_hf_weights(self, folder: str) -> None:
        """Rank 0 writes the current policy as a transformers checkpoint into `folder` (rollout servers)."""
        self.call_all("save_hf_weights", [(folder,)] * self.world_size)

    def save(self, directory: str) -> None:
        self.call_all("save", [(directory,)] * self.world_size)

    def load(self, directory: str) -> None:
        self.call_all("load", [(directory,)] * self.world_size)


class GroupRolloutEngine:
    """The policy ranks' colocated engines as one `RolloutEngine` for the loop.

    load_weights() syncs every rank's engine from its FSDP shards (the argument is ignored: the weights
    never pass through the driver). Each rank's engine holds its KV cache only while it generates.
    """

    def __init__(self, policy: PolicyGroup, pad_id: int) -> None:
        self.policy, self.pad_id = policy, pad_id
        self.last_sync_s = 0.0

    def generate(self, prompt_ids: list[list[int]], sampling) -> list:
        return self.policy.generate(prompt_ids, sampling)

    def load_weights(self, _state_dict_or_model=None) -> None:
        self.last_sync_s = self.policy.sync_weights()

    def release_memory(self) -> None:
        """Nothing to do: the ranks' KV caches exist only inside generate()."""

    def resume_memory(self) -> None:
        """Nothing to do: generate() allocates the KV caches."""

    def close(self) -> None:
        """The ranks' engines end with their group (Groups.shutdown)."""


class GroupWeights:
    """The policy group's current weights in the form RolloutManager.load_weights takes a model: it calls
    save_pretrained(folder), and rank 0 writes the checkpoint there (the folder must be reachable from
    rank 0's node: one node, or a shared file system)."""

    def __init__(self, policy: PolicyGroup) -> None:
        self.policy = policy

    def save_pretrained(self, folder, safe_serialization: bool = True) -> None:
        self.policy.save_hf_weights(str(folder))
