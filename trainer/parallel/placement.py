"""Where ranks live: the Ray cluster, one bundle per GPU, a rank's actor, and what a lost rank says.

A role's ranks are `LocalRanks` (one rank in this process: a CPU run or one GPU) or `RayRanks` (one
`RankActor` per bundle of a `ResourcePool`); both hold the same rank objects (trainer/parallel/ranks.py)
and answer `call_all`, so the role groups above them (trainer/parallel/groups.py) never branch on it.
`RankReplica` is a Ray policy rank's engine as a replica of the driver's rollout manager.

Placement: `ResourcePool` reserves one bundle per GPU, as one placement group per node packed onto
that node, so ranks 0..k-1 share node 0, and so on. Roles are colocated by default: rank r of every
role lives in one process, the actor of bundle r (the policy, its rollout engine, the reference and
the critic share each GPU and its memory, as verl's hybrid engine does: one CUDA context, one caching
allocator, and a pass's freed memory is the next pass's); giving roles separate pools puts them on
separate GPUs, in processes of their own.

Failure: a Ray rank that dies or raises leaves its peers blocked in a collective. The ranks are waited
for one at a time and the first failure stops them: the whole role is killed (so nothing hangs) and
`WorkerGroupError` names the role, the rank and the call; the loop adds the last checkpoint. Across
nodes the message also names the rank's node by IP and hostname, and says when that node left the Ray
cluster (`rank_failure`): a lost node is what a multi-node user needs to see first.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.parallel.distributed import NCCL_ENV, free_port, init_data_parallel, local_data_parallel
from trainer.profiling import new_profiler, write_profile
from trainer.rollout.base import pack_rollouts, unpack_rollouts

log = logging.getLogger("trainer")

PLACEMENT_TIMEOUT_S = 300.0
REPLICA_CALLS = "replica"  # the rank actors' concurrency group for the rollout manager's requests
MAX_REPLICA_CALLS = 512  # requests a rank's engine may have in flight at once (threads in that group)
# After a rank raised an ordinary error, how long to wait for a peer whose process or node went away
# (a lost node makes its peers' collectives fail too, often first): that peer is the cause to report.
ROOT_CAUSE_WAIT_S = 5.0


class WorkerGroupError(RuntimeError):
    """A rank of a role group died or failed; the group has been shut down."""


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
    runtime_env = {"env_vars": rank_env()}
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
            # batches are token ids and [B, T] tensors: a small store starts faster, leaves memory to torch
            object_store_memory=int(os.environ.get("TRAINER_RAY_OBJECT_STORE_BYTES", 512 * 2**20)),
        )
        return "started a local Ray cluster"
    ray.init(address=address, runtime_env=runtime_env)
    return f"joined the Ray cluster at {address}"


# The driver's settings of these reach its ranks too: the allocator's, which the ranks need more than it
# does (e.g. expandable_segments, so that the KV cache and the training passes share pages).
PASSED_TO_RANKS = ("PYTORCH_CUDA_ALLOC_CONF",)


def rank_env() -> dict[str, str]:
    """The environment every Ray worker of this run gets: NCCL_ENV, this checkout on PYTHONPATH, and the
    driver's PASSED_TO_RANKS settings."""
    # Workers of a local cluster must import this checkout even when it is not installed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    passed = {name: os.environ[name] for name in PASSED_TO_RANKS if name in os.environ}
    return {**NCCL_ENV, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **passed}


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


# ------------------------------------------------------------------------------ where ranks live


class RankActor:
    """The Ray actor of one rank: its device, its process group and the rank object built there.

    Plumbing only: what a rank does is the rank object's (trainer/parallel/ranks.py); `call` forwards.
    `call` runs one at a time on the actor's one default thread (a thread Ray made, not the main one: the
    same speed, bench/thread_probe.py); `replica` calls, the rollout manager's requests, run concurrently
    in their own concurrency group, each awaiting the rank's engine on an event loop of the rank's own.
    """

    def __init__(self, rank: int, world_size: int, use_gpu: bool, seed: int) -> None:
        self.rank, self.world_size, self.use_gpu, self.seed = rank, world_size, use_gpu, seed
        self.roles: dict[str, Any] = {}  # the rank objects of the roles colocated in this process
        self.dp, self.device = None, None
        self.profiler = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_lock = threading.Lock()
        # rollouts_many's requests by (batch, position), and cancellations that came before their batch
        self.requests: dict[int, list[asyncio.Task]] = {}
        self.cancelled_early: dict[int, set[int]] = {}
        self.last_batch = -1

    def node_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, role: str, build: Callable, master_addr: str | None, master_port: int | None) -> int:
        """Build `role`'s rank object here; the first role also joins the ranks' process group (the roles
        after it share that group: their collectives are called in the same order on every rank)."""
        if self.dp is None:
            device = torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")  # Ray set the GPU
            self.dp = init_data_parallel(
                rank=self.rank,
                world_size=self.world_size,
                master_addr=master_addr,
                master_port=master_port,
                device=device,
            )
            self.device = device
        torch.manual_seed(self.seed + self.rank)
        self.roles[role] = build(self.dp, self.device)
        # as the driver does (trainer/loop.py): a rank process holds ~440k long-lived objects (torch,
        # transformers, Ray; 0.22-0.25 s a full collection on a 2-core CPU), and a collection on one rank
        # holds every rank up at its next collective
        gc.collect()
        gc.freeze()
        return os.getpid()

    def call(self, role: str, method: str, *args, **kwargs):
        with torch.profiler.record_function(f"rank.{method}"):  # the phase, in a profiled step's trace
            return getattr(self.roles[role], method)(*args, **kwargs)

    @property
    def engine(self):
        """The policy rank's engine replica (the rollout manager's calls go to it)."""
        return self.roles["policy"].replica

    def replica(self, method: str, *args, **kwargs):
        """A call of the rollout manager on this rank's engine replica (a coroutine method of it)."""
        return asyncio.run_coroutine_threadsafe(
            getattr(self.engine, method)(*args, **kwargs), self._replica_loop()
        ).result()

    def rollouts_many(self, calls: list[tuple], batch: int = 0):
        """Several `rollouts` calls of this rank's replica at once, all started before any is awaited;
        yields, for the calls finished since the last yield, (positions, rollouts per call, their rollouts
        packed, (position, error) of the failed). RankReplica sends the requests the manager made in one
        turn of its event loop this way: the engine gets a batch's prompts together instead of one Ray call
        at a time (spread over ~0.1-0.2 s at 4 ranks, so its last prompts started late), and each prompt's
        group still comes back as soon as it is done (a Ray streaming generator), in one message with the
        others that ended with it. `batch` names the call for `cancel_rollouts`."""
        loop = self._replica_loop()
        replica = self.engine
        finished: queue.SimpleQueue = queue.SimpleQueue()

        async def start() -> list[asyncio.Task]:
            tasks = [asyncio.ensure_future(replica.rollouts(*args)) for args in calls]
            for position, task in enumerate(tasks):
                task.add_done_callback(lambda _, position=position: finished.put(position))
            return tasks

        with torch.profiler.record_function("replica.start_rollouts"):  # when the calls reached the rank
            tasks = asyncio.run_coroutine_threadsafe(start(), loop).result()
        with self.loop_lock:
            self.requests[batch], self.last_batch = tasks, max(self.last_batch, batch)
            early = self.cancelled_early.pop(batch, set())
        if early:
            self.cancel_rollouts([(batch, position) for position in early])
        try:
            remaining = len(tasks)
            while remaining:  # each wake-up takes every answer that is in by then
                done = [finished.get()]
                while not finished.empty():
                    done.append(finished.get())
                remaining -= len(done)
                answered = [i for i in done if not tasks[i].cancelled()]
                served = [i for i in answered if tasks[i].exception() is None]
                failed = [(i, tasks[i].exception()) for i in answered if tasks[i].exception() is not None]
                with torch.profiler.record_function("replica.pack_rollouts"):
                    packed = pack_rollouts([rollout for i in served for rollout in tasks[i].result()])
                yield served, [len(tasks[i].result()) for i in served], packed, failed
        finally:
            with self.loop_lock:
                self.requests.pop(batch, None)

    def cancel_rollouts(self, requests: list[tuple[int, int]]) -> None:
        """Cancel requests the driver gave up on, by (batch, position), and return once each has ended (its
        engine work aborted): the KV release after a failed round then finds no request running. A
        cancellation may arrive before its batch (Ray does not order a threaded actor's calls): it is
        kept until the batch starts."""
        tasks = []
        with self.loop_lock:
            for batch, position in requests:
                if batch in self.requests:
                    tasks.append(self.requests[batch][position])
                elif batch > self.last_batch:
                    self.cancelled_early.setdefault(batch, set()).add(position)
        if not tasks:
            return

        async def cancel() -> None:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

        asyncio.run_coroutine_threadsafe(cancel(), self._replica_loop()).result()

    def _replica_loop(self) -> asyncio.AbstractEventLoop:
        with self.loop_lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, name="replica", daemon=True).start()
        return self.loop

    def start_profile(self) -> None:
        """torch.profiler from now until stop_profile (trainer.profile_steps reaching into the ranks); a
        process of several roles is profiled once, from the first role's start to its stop."""
        if self.profiler is None:
            self.profiler = new_profiler()
            self.profiler.__enter__()

    def stop_profile(self, folder: str, name: str) -> None:
        """Stop the profiler; write folder/<name>_rank<R>.txt and .json on this rank's node."""
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)
            write_profile(profiler, Path(folder), f"{name}_rank{self.rank}")

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayRanks:
    """A role's ranks as Ray actors over a resource pool, one per bundle."""

    remote = True

    def __init__(
        self, pool: ResourcePool, build: Callable, *, role: str, seed: int, host: RayRanks | None = None
    ) -> None:
        """build(dp, device) -> the rank object, run in every rank's process. host: a colocated role's
        ranks, whose processes this role's rank objects join (one process a GPU), instead of actors of
        its own on the pool's bundles."""
        self.role, self.world_size = role, pool.world_size
        self.failure: str | None = None
        self.rank_nodes: list[str] = []  # each rank's Ray node id, to name a lost node
        if host is not None:
            self.actors, self.rank_nodes = host.actors, host.rank_nodes
            self.pids = self._wait(
                [actor.setup.remote(role, build, None, None) for actor in self.actors], "setup"
            )
            return
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(concurrency_groups={REPLICA_CALLS: MAX_REPLICA_CALLS})(RankActor)
        self.actors = [
            remote.options(
                num_cpus=1,
                num_gpus=1 if pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
                ),
                runtime_env={"env_vars": dict(NCCL_ENV)},
            ).remote(rank, self.world_size, pool.use_gpu, seed)
            for rank, slot in enumerate(pool.slots)
        ]
        master_addr, master_port = self._wait([self.actors[0].node_address.remote()], "start")[0]
        self.pids = self._wait(
            [actor.setup.remote(role, build, master_addr, master_port) for actor in self.actors], "setup"
        )
        self.rank_nodes = self.node_ids()

    def call_all(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs) -> list:
        """Call `method` on every rank (rank r gets per_rank_args[r]); the results in rank order."""
        if self.failure is not None:
            raise WorkerGroupError(f"the {self.role} group was shut down after: {self.failure}")
        per_rank_args = per_rank_args or [()] * self.world_size
        refs = [
            actor.call.remote(self.role, method, *args, **kwargs)
            for actor, args in zip(self.actors, per_rank_args)
        ]
        return self._wait(refs, method)

    def replicas(self) -> list[RankReplica]:
        return [RankReplica(actor, f"{self.role} rank {rank}") for rank, actor in enumerate(self.actors)]

    def start_profile(self) -> None:
        self._wait([actor.start_profile.remote() for actor in self.actors], "start_profile")

    def stop_profile(self, folder: str, name: str) -> None:
        self._wait([actor.stop_profile.remote(folder, name) for actor in self.actors], "stop_profile")

    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order."""
        return self._wait([actor.node_id.remote() for actor in self.actors], "node_id")

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
                self.failure = f"{self.role} rank {rank} of {self.world_size} failed during {what}: {reason}"
                raise WorkerGroupError(self.failure) from exc
        return ray.get(refs)

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class LocalRanks:
    """A role's one rank in this process (CPU runs, one GPU): the rank object a Ray actor would hold,
    over a process group of one. Its failures propagate as they are; its profile is the driver's."""

    remote = False
    world_size = 1

    def __init__(self, build: Callable, *, role: str, device: torch.device, seed: int) -> None:
        self.role = role
        torch.manual_seed(seed)  # as a Ray rank 0 seeds itself before it builds
        self.rank = build(local_data_parallel(device), device)

    def call_all(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs) -> list:
        args = per_rank_args[0] if per_rank_args else ()
        with torch.profiler.record_function(f"rank.{method}"):  # the phases, as in a Ray rank's trace
            return [getattr(self.rank, method)(*args, **kwargs)]

    def replicas(self) -> list:
        return [self.rank.replica]

    def start_profile(self) -> None:
        """Nothing to start: the driver's profiler sees this process."""

    def stop_profile(self, folder: str, name: str) -> None:
        """Nothing to write: the driver's profile holds this rank's work."""

    def node_ids(self) -> list[str]:
        return ["local"]

    def shutdown(self) -> None:
        close = getattr(self.rank, "close", None)
        if close is not None:
            close()


Ranks = RayRanks | LocalRanks


class RankReplica:
    """A Ray policy rank's engine as a replica of the rollout manager (rollout/pool.py's Replica calls the
    trainer uses). The `rollouts` requests made in one turn of the manager's event loop (a batch's
    prompts, handed out together) go to the rank as one streaming call, `RankActor.rollouts_many`; each
    request's result comes back on its own as the rank yields it."""

    def __init__(self, actor, name: str) -> None:
        self.actor, self.name = actor, name
        self.capacity: int | None = None
        self._waiting: list[tuple[tuple, asyncio.Future]] = []
        self._sending: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)
        self.batches = 0  # streaming calls sent (requests arrive in fewer, larger batches than one each)
        self._sent: dict[asyncio.Future, tuple[int, int]] = {}  # a sent request's (batch, position)
        self._cancels: list[tuple[int, int]] = []  # requests given up on this turn, for the rank to stop
        self._cancelling: set[asyncio.Task] = set()

    async def rollouts(self, payload: dict, prompt_index: int):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._waiting:  # the first request of this turn: send the turn's requests once it is over
            loop.call_soon(self._send_turn)
        self._waiting.append(((payload, prompt_index), future))
        try:
            return await future
        except asyncio.CancelledError:  # the caller gave up: the rank stops generating it too
            self._give_up(future)
            raise

    async def release_memory_occupation(self, tags=None) -> None:
        if self._cancelling:  # the rank's engine must have stopped what was cancelled before it releases
            await asyncio.gather(*self._cancelling, return_exceptions=True)
        await self._call("release_memory_occupation", tags)

    async def resume_memory_occupation(self, tags=None) -> None:
        await self._call("resume_memory_occupation", tags)

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        """The engine ends with its rank (the group's shutdown)."""

    def _send_turn(self) -> None:
        waiting, self._waiting = self._waiting, []
        if not waiting:  # every request of the turn was cancelled before it went
            return
        self.batches += 1
        futures = [f for _, f in waiting]
        self._sent |= {future: (self.batches, position) for position, future in enumerate(futures)}
        task = asyncio.ensure_future(self._send([args for args, _ in waiting], futures, self.batches))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _give_up(self, future: asyncio.Future) -> None:
        """A request's caller cancelled it: not sent yet, it is not sent; else the rank is told (the
        cancellations of one turn in one call)."""
        self._waiting = [(args, f) for args, f in self._waiting if f is not future]
        if future not in self._sent:
            return
        if not self._cancels:
            asyncio.get_running_loop().call_soon(self._send_cancels)
        self._cancels.append(self._sent.pop(future))

    def _send_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        call = self.actor.cancel_rollouts.options(concurrency_group=REPLICA_CALLS).remote(cancels)
        task = asyncio.ensure_future(_settled(call))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def _send(self, calls: list[tuple], futures: list[asyncio.Future], batch: int) -> None:
        from ray.exceptions import RayActorError

        from trainer.rollout.client import ReplicaDown

        failure: BaseException = RuntimeError(f"{self.name} ended a batch of requests without answering all")
        try:
            many = self.actor.rollouts_many.options(concurrency_group=REPLICA_CALLS)
            async for ref in many.remote(calls, batch):
                positions, counts, packed, errors = await ref
                rollouts, start = unpack_rollouts(packed), 0
                for index, count in zip(positions, counts):
                    if not futures[index].done():  # else its caller gave up (cancelled)
                        futures[index].set_result(rollouts[start : start + count])
                    start += count
                for index, error in errors:
                    if not futures[index].done():
                        futures[index].set_exception(error)
        except RayActorError as exc:
            failure = ReplicaDown(f"{self.name}: {_first_line(exc)}")
        except Exception as exc:  # noqa: BLE001 - it fails this turn's requests, not the manager's loop
            failure = exc
        for future in futures:
            self._sent.pop(future, None)
            if not future.done():
                future.set_exception(failure)

    async def _call(self, method: str, *args):
        from ray.exceptions import RayActorError

        from trainer.rollout.client import ReplicaDown

        try:
            return await self.actor.replica.options(concurrency_group=REPLICA_CALLS).remote(method, *args)
        except RayActorError as exc:
            raise ReplicaDown(f"{self.name}: {_first_line(exc)}") from exc


async def _settled(call) -> None:
    """Await a Ray call whose failure changes nothing (a cancellation the rank may no longer hear); a
    failure of a live rank is logged: its engine may still be generating what the driver gave up on."""
    from ray.exceptions import RayActorError

    try:
        await call
    except RayActorError:  # a rank that is gone has nothing left to stop
        pass
    except Exception as exc:  # noqa: BLE001 - a cancellation that failed stops nothing else
        log.warning("cancel_rollouts failed on a live rank: %s", _first_line(exc))


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
