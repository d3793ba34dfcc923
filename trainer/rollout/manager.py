"""RolloutManager: every rollout of a run goes through it, over a ReplicaPool.

    prompts --one request per prompt (its n samples)--> least-loaded replica with room --> Rollouts

The replicas are the policy ranks' colocated engines (in this process, or in Ray ranks) or rollout
servers (SGLang's HTTP API). Each prompt is its own request, so a prompt whose samples finish early
never waits on another's, and the fit loop scores each prompt's group as soon as it is back; the agent
loop sends every turn of a trajectory through the same pool, to the replica of its first turn. The pool
is async and lives on the fit loop's event loop (`loop=`): the loop's requests, the agent loop's turns
and the replicas' answers never change threads (two threads handing each request over took turns at
the GIL: at 4 GPUs the last of 256 prompts reached the ranks ~0.4 s after the first, py-spy). Built
without a loop, the manager runs one on its own thread, for blocking callers (`generate()`).

Weights: the policy ranks sync their colocated engines themselves (a collective inside the group);
for rollout servers the manager sends a checkpoint written to `weights_dir`
(/update_weights_from_disk, which SGLang and our server both implement), or tensors to an in-process
LocalReplica.

`build_rollout` makes the run's manager from `actor_rollout_ref.rollout.name`:
hf       transformers generate on each policy rank, next to its model (trainer/workers/engines.py)
builtin  the built-in fast engine on each policy rank, next to its model
sglang   SGLang servers: the given URLs, or one `python -m sglang.launch_server` per GPU group,
         started here and stopped by close()
SGLang servers load new weights from a checkpoint folder (/update_weights_from_disk). Servers on other
machines (ROLLOUT_SERVER_URLS) can read it only from a shared filesystem: ROLLOUT_WEIGHTS_DIR names
that folder (default: a temporary folder on this machine, fine for servers started here).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from trainer.rollout.base import Rollout, SamplingParams, derived_seed
from trainer.rollout.pool import Replica, ReplicaPool
from trainer.rollout.protocol import wire_sampling

T = TypeVar("T")
RolloutName = Literal["hf", "builtin", "sglang"]
log = logging.getLogger(__name__)

URLS_ENV = "ROLLOUT_SERVER_URLS"  # comma-separated, like the services' *_URL variables
WEIGHTS_DIR_ENV = "ROLLOUT_WEIGHTS_DIR"  # where weight checkpoints for the servers go (a shared path)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})
# The share of a GPU a started SGLang server takes (verl's rollout.gpu_memory_utilization default), so a
# trainer on the same GPU keeps the rest.
SGLANG_MEMORY_FRACTION = 0.5


class RolloutManager:
    def __init__(
        self,
        pool: ReplicaPool,
        *,
        weights_dir: str | None = None,
        config_dir: str | None = None,
        servers=None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """weights_dir: where checkpoints for HTTP replicas go (default: a temporary folder, in /dev/shm when
        it exists). config_dir: the model folder whose config.json (and tokenizer files) such a checkpoint
        needs when load_weights gets a state dict. servers: launcher.RolloutServers this manager started;
        close() stops them. loop: the running loop to live on (the fit loop's: its requests then need no
        other thread); without it the manager runs its own loop on a thread, for blocking callers."""
        self.pool = pool
        self.servers = servers
        self.config_dir = config_dir
        self._weights_dir = weights_dir
        self._temporary_weights_dir: str | None = None  # made at the first write when none was named
        self._last_checkpoint: str | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        if loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="rollout-manager", daemon=True)
            self._thread.start()
        self._loop = loop

    # -------------------------------------------------------------------------------- rollouts

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
        return await self._here(self._generate(prompt_ids, sampling, first_index, key))

    def forget(self, keys: Sequence[str]) -> None:
        """These routing keys are done (finished trajectories)."""
        self._loop.call_soon_threadsafe(self.pool.forget, list(keys))

    async def release_memory_async(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's memory tags: "kv_cache", "weights"; None: both."""
        await self._here(self.pool.broadcast(lambda r: r.release_memory_occupation(tags)))

    async def resume_memory_async(self, tags: Sequence[str] | None = None) -> None:
        await self._here(self.pool.broadcast(lambda r: r.resume_memory_occupation(tags)))

    def load_weights(self, state_dict_or_model) -> None:
        """Send the policy's current weights to every replica."""
        self._run(self._load_weights(state_dict_or_model))

    async def load_weights_async(self, state_dict_or_model) -> None:
        await self._here(self._load_weights(state_dict_or_model))

    def close(self) -> None:
        if not self._closed:
            self._run(self.pool.close())
            self._stop()

    async def close_async(self) -> None:
        if not self._closed:
            await self._here(self.pool.close())
            self._stop()

    def _stop(self) -> None:
        self._closed = True
        if self._thread is not None:  # its own loop: stopped and closed (a loop it was given stays)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()
            self._thread = None
        if self.servers is not None:
            self.servers.stop()
        if self._temporary_weights_dir is not None:  # a full copy of the model, in /dev/shm where it can
            shutil.rmtree(self._temporary_weights_dir, ignore_errors=True)

    # -------------------------------------------------------------------------------- internals

    async def _here(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await coro on the manager's loop: directly from it, else handed to its thread."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(self._submit(coro))

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            on_own_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs in this thread
            on_own_loop = False
        if on_own_loop:
            coro.close()
            raise RuntimeError("RolloutManager's blocking calls cannot run on its own event loop")
        return self._submit(coro).result()

    async def _generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        first_index: int = 0,
        key: str | None = None,
    ) -> list[Rollout]:
        await self.pool.revive(self._resync)
        if len(prompt_ids) == 1:  # the fit loop's and the agent loop's requests: no task to gather
            return await self._prompt(first_index, prompt_ids[0], sampling, key)
        groups = await asyncio.gather(
            *(self._prompt(first_index + i, p, sampling, key) for i, p in enumerate(prompt_ids))
        )
        return [rollout for group in groups for rollout in group]

    async def _prompt(
        self, index: int, prompt: list[int], sampling: SamplingParams, key: str | None = None
    ) -> list[Rollout]:
        """Prompt number `index`'s n samples, from the replica the pool picks."""
        params = (
            sampling
            if sampling.seed is None
            else replace(sampling, seed=derived_seed(sampling.seed, index, 0))
        )
        payload = {
            "input_ids": list(prompt),
            "sampling_params": wire_sampling(params),
            "return_logprob": True,
        }
        return await self.pool.rollouts(payload, index, weight=sampling.n, key=key)

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
                prefix="rollout-weights-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
            )
        root = Path(self._weights_dir)
        folder = root / "latest"
        staging = root / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(source, Mapping):
            from safetensors.torch import save_file

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


def host_tensors(named_tensors: Mapping) -> dict:
    """Contiguous CPU copies for safetensors, each storage once: tied weights (lm_head = embed_tokens)
    keep their first name only, and the receiving engine ties them again."""
    seen, out = set(), {}
    for name, tensor in named_tensors.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def _in_process(replica: Replica) -> bool:
    from trainer.rollout.local import LocalReplica

    return isinstance(replica, LocalReplica)


def http_manager(
    urls: Sequence[str],
    *,
    config_dir: str | None = None,
    token: str | None = None,
    servers=None,
    weights_dir: str | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> RolloutManager:
    """A manager over rollout servers (SGLang or built-in) at `urls` (servers: stopped by close()).
    weights_dir: where /update_weights_from_disk checkpoints go; a path the servers see too (a shared
    filesystem) when they run on other machines."""
    from trainer.rollout.client import HttpReplica

    pool = ReplicaPool([HttpReplica(u, token=token) for u in urls])
    return RolloutManager(pool, config_dir=config_dir, servers=servers, weights_dir=weights_dir, loop=loop)


def server_urls_from_env() -> list[str]:
    return [url.strip() for url in os.environ.get(URLS_ENV, "").split(",") if url.strip()]


def weights_dir_from_env() -> str | None:
    return os.environ.get(WEIGHTS_DIR_ENV, "").strip() or None


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (one server is started on each)."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def build_rollout(
    name: RolloutName,
    *,
    replicas: Sequence = (),
    model_path: str,
    server_urls: Sequence[str] = (),
    gpus: Sequence[str] = (),
    tp_size: int = 1,
    gpu_memory_utilization: float = SGLANG_MEMORY_FRACTION,
    seeded: bool = True,
    weights_dir: str | None = None,
    token: str | None = None,
    trust_remote_code: bool = False,
    tokenizer_path: str | None = None,
    startup_timeout_s: float = 900.0,
    loop: asyncio.AbstractEventLoop | None = None,
) -> RolloutManager:
    """The run's rollout manager: over the policy ranks' colocated engines (`replicas`: hf, builtin), or
    over SGLang servers (the given URLs, or one started per group of `tp_size` GPUs here and stopped by
    close()). `seeded`: the loop sends sampling_seed (it always does), so started SGLang servers run with
    --enable-deterministic-inference; servers given by URL are checked by the client instead.
    `weights_dir`: the folder weight checkpoints for the servers are written to (created here).
    `token`: the bearer token sent to the servers (services.auth_token; servers started here listen
    on loopback only and ask for none). `trust_remote_code` (the model's or the tokenizer's) and
    `tokenizer_path` (data.tokenizer): for started servers. `loop`: the running loop the manager lives on
    (RolloutManager)."""
    if name in ("hf", "builtin"):
        return RolloutManager(ReplicaPool(list(replicas)), loop=loop)
    if name == "sglang":
        from trainer.rollout.launcher import sglang_servers

        servers = None
        if not server_urls:
            if not gpus:
                raise ValueError(
                    f"rollout.name=sglang needs server URLs ({URLS_ENV}) or GPUs to start servers on"
                )
            servers = sglang_servers(
                model_path,
                list(gpus),
                tp_size=tp_size,
                mem_fraction_static=gpu_memory_utilization,
                deterministic_inference=seeded,
                trust_remote_code=trust_remote_code,
                tokenizer_path=tokenizer_path,
            ).start(startup_timeout_s)
            server_urls = servers.urls
        if weights_dir is not None:
            Path(weights_dir).mkdir(parents=True, exist_ok=True)  # fail now, not at the first weight sync
        elif servers is None and any(urlsplit(url).hostname not in LOOPBACK_HOSTS for url in server_urls):
            log.warning(
                "rollout servers %s may be on other machines, and their weights will be written to a "
                "temporary folder on this one; set %s to a path they share",
                ", ".join(server_urls),
                WEIGHTS_DIR_ENV,
            )
        return http_manager(
            list(server_urls),
            config_dir=model_path,
            token=token,
            servers=servers,
            weights_dir=weights_dir,
            loop=loop,
        )
    raise ValueError(f"rollout.name must be hf, builtin or sglang, not {name!r}")
