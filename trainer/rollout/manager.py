"""RolloutManager: every rollout of a run goes through it, over a ReplicaPool.

    prompts --one request per prompt (its n samples)--> least-loaded replica with room --> Rollouts

The replicas are the policy ranks' colocated engines (in this process, or in Ray ranks) or rollout
servers (SGLang's HTTP API). Each prompt is its own request, so a prompt whose samples finish early
never waits on another's, and the fit loop scores each prompt's group as soon as it is back; the agent
loop sends every turn of a trajectory through the same pool, to the replica of its first turn. The pool
is async and lives on the manager's own event-loop thread: `generate_async()` awaits the work from the
fit loop's event loop without blocking it; `generate()` is the blocking form.

Weights: the policy ranks sync their colocated engines themselves (a collective inside the group);
for rollout servers the manager sends a checkpoint written to `weights_dir`
(/update_weights_from_disk, which SGLang and our server both implement), or tensors to an in-process
LocalReplica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import tempfile
import threading
from dataclasses import replace
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar


from trainer.rollout.base import Rollout, SamplingParams
from trainer.rollout.pool import Replica, ReplicaPool
from trainer.rollout.protocol import sample_seed, wire_sampling

T = TypeVar("T")


class RolloutManager:
    def __init__(
        self,
        pool: ReplicaPool,
        *,
        pad_id: int,
        weights_dir: str | None = None,
        config_dir: str | None = None,
        servers=None,
    ) -> None:
        """pad_id: what TrainBatch pads with. weights_dir: where checkpoints for HTTP replicas go
        (default: a temporary folder, in /dev/shm when it exists). config_dir: the model folder whose
        config.json (and tokenizer files) such a checkpoint needs when load_weights gets a state dict.
        servers: launcher.RolloutServers this manager started; close() stops them."""
        self.pool, self.pad_id = pool, pad_id
        self.servers = servers
        self.config_dir = config_dir
        self._weights_dir = weights_dir
        self._temporary_weights_dir: str | None = None  # made at the first write when none was named
        self._last_checkpoint: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-manager", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------- RolloutEngine

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        return self._run(self._generate(prompt_ids, sampling))

    async def generate_async(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        *,
        first_index: int = 0,
        key: str | None = None,
    ) -> list[Rollout]:
        """n samples of each prompt; prompt i is number first_index + i of its batch (its prompt_index,
        and its seed's). key: route every request with this key to one replica (a trajectory's turns)."""
        return await asyncio.wrap_future(self._submit(self._generate(prompt_ids, sampling, first_index, key)))

    def forget(self, keys: Sequence[str]) -> None:
        """These routing keys are done (finished trajectories)."""
        self._loop.call_soon_threadsafe(self.pool.forget, list(keys))

    async def release_memory_async(self, tags: Sequence[str] | None = None) -> None:
        await asyncio.wrap_future(
            self._submit(self.pool.broadcast(lambda r: r.release_memory_occupation(tags)))
        )

    async def resume_memory_async(self, tags: Sequence[str] | None = None) -> None:
        await asyncio.wrap_future(
            self._submit(self.pool.broadcast(lambda r: r.resume_memory_occupation(tags)))
        )

    def load_weights(self, state_dict_or_model) -> None:
        """Send the policy's current weights to every replica."""
        self._run(self._load_weights(state_dict_or_model))

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's memory tags: "kv_cache", "weights"; None: both."""
        self._run(self.pool.broadcast(lambda r: r.release_memory_occupation(tags)))

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._run(self.pool.broadcast(lambda r: r.resume_memory_occupation(tags)))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.pool.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        if self.servers is not None:
            self.servers.stop()
        if self._temporary_weights_dir is not None:  # a full copy of the model, in /dev/shm where it can
            shutil.rmtree(self._temporary_weights_dir, ignore_errors=True)

    # -------------------------------------------------------------------------------- internals

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("RolloutManager's blocking calls cannot run on its own event-loop thread")
        return self._submit(coro).result()

    async def _generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        first_index: int = 0,
        key: str | None = None,
    ) -> list[Rollout]:
        await self.pool.revive(self._resync)

        async def one(index: int, prompt: list[int]) -> list[Rollout]:
            params = (
                sampling
                if sampling.seed is None
                else replace(sampling, seed=sample_seed(sampling.seed, index, 0))
            )
            payload = {
                "input_ids": list(prompt),
                "sampling_params": wire_sampling(params),
                "return_logprob": True,
            }
            return await self.pool.rollouts(payload, index, weight=sampling.n, key=key)

        groups = await asyncio.gather(*(one(first_index + i, p) for i, p in enumerate(prompt_ids)))
        return [rollout for group in groups for rollout in group]

    async def _load_weights(self, source) -> None:
        state = source if isinstance(source, Mapping) else None
        checkpoint: list[str] = []  # written at most once, only if some replica needs a file

        async def send(replica: Replica) -> None:
            if _in_process(replica):
                await replica.update_weights_from_tensor(state if state is not None else source.state_dict())
                return
            if not checkpoint:
                checkpoint.append(await asyncio.to_thread(self._write_checkpoint, source))
            await replica.update_weights_from_disk(checkpoint[0])

        await self.pool.update_weights(send)

    async def _resync(self, replica: Replica) -> None:
        if self._last_checkpoint is None or _in_process(replica):
            raise RuntimeError(f"cannot re-send weights to {replica.name}")
        await replica.update_weights_from_disk(self._last_checkpoint)

    def _write_checkpoint(self, source) -> str:
        """The weights as a transformers checkpoint folder (config + safetensors); returns its path."""
        if self._weights_dir is None:
            self._weights_dir = self._temporary_weights_dir = tempfile.mkdtemp(
                prefix="rollout-weights-", dir=_fast_tmp()
            )
        root = Path(self._weights_dir)
        folder = root / "latest"
        staging = root / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(source, Mapping):
            from safetensors.torch import save_file

            from trainer.rollout.client import host_tensors

            if self.config_dir is None:
                raise ValueError("load_weights(state_dict) for HTTP replicas needs config_dir")
            staging.mkdir(parents=True)
            for name in ("config.json", "generation_config.json"):
                if (Path(self.config_dir) / name).exists():
                    shutil.copy(Path(self.config_dir) / name, staging / name)
            save_file(host_tensors(source), staging / "model.safetensors")
        else:
            source.save_pretrained(staging, safe_serialization=True)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        self._last_checkpoint = str(folder)
        return str(folder)


def _in_process(replica: Replica) -> bool:
    from trainer.rollout.local import LocalReplica

    return isinstance(replica, LocalReplica)


def _fast_tmp() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def local_manager(engine, tokenizer=None, *, pad_id: int, capacity: int | None = None) -> RolloutManager:
    """A manager over a built-in engine in this process (benchmarks and tests of the engine)."""
    from trainer.rollout.builtin.worker import EngineWorker
    from trainer.rollout.local import LocalReplica

    replica = LocalReplica(EngineWorker(engine), tokenizer, with_text=False)
    return RolloutManager(ReplicaPool([replica], capacity=capacity), pad_id=pad_id)


def http_manager(
    urls: Sequence[str],
    *,
    pad_id: int,
    config_dir: str | None = None,
    token: str | None = None,
    servers=None,
    weights_dir: str | None = None,
    **pool_kwargs,
) -> RolloutManager:
    """A manager over rollout servers (SGLang or built-in) at `urls` (servers: stopped by close()).
    weights_dir: where /update_weights_from_disk checkpoints go; a path the servers see too (a shared
    filesystem) when they run on other machines."""
    from trainer.rollout.client import HttpReplica

    pool = ReplicaPool([HttpReplica(u, token=token) for u in urls], **pool_kwargs)
    return RolloutManager(
        pool, pad_id=pad_id, config_dir=config_dir, servers=servers, weights_dir=weights_dir
    )
