"""The run's rollout manager from `actor_rollout_ref.rollout.name`: one RolloutManager in every case.

hf       transformers generate on each policy rank, next to its model (trainer/workers/engines.py)
builtin  the built-in fast engine on each policy rank, next to its model
sglang   SGLang servers: the given URLs, or one `python -m sglang.launch_server` per GPU group,
         started here and stopped by close()
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch

from trainer.rollout.manager import RolloutManager, http_manager
from trainer.rollout.pool import ReplicaPool

RolloutName = Literal["hf", "builtin", "sglang"]
URLS_ENV = "ROLLOUT_SERVER_URLS"  # comma-separated, like the services' *_URL variables
# The share of a GPU a started SGLang server takes (verl's rollout.gpu_memory_utilization default), so a
# trainer on the same GPU keeps the rest.
SGLANG_MEMORY_FRACTION = 0.5


def server_urls_from_env() -> list[str]:
    return [url.strip() for url in os.environ.get(URLS_ENV, "").split(",") if url.strip()]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (one server is started on each)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def build_rollout(
    name: RolloutName,
    *,
    replicas: Sequence = (),
    pad_id: int,
    model_path: str,
    server_urls: Sequence[str] = (),
    gpus: Sequence[str] = (),
    tp_size: int = 1,
    gpu_memory_utilization: float = SGLANG_MEMORY_FRACTION,
    startup_timeout_s: float = 900.0,
) -> RolloutManager:
    """The run's rollout manager: over the policy ranks' colocated engines (`replicas`: hf, builtin), or
    over SGLang servers (the given URLs, or one started per GPU group here and stopped by close())."""
    if name in ("hf", "builtin"):
        return RolloutManager(ReplicaPool(list(replicas)), pad_id=pad_id)
    if name == "sglang":
        from trainer.rollout.launcher import sglang_servers

        servers = None
        if not server_urls:
            if not gpus:
                raise ValueError(
                    f"rollout.name=sglang needs server URLs ({URLS_ENV}) or GPUs to start servers on"
                )
            servers = sglang_servers(
                model_path, list(gpus), tp_size=tp_size, mem_fraction_static=gpu_memory_utilization
            ).start(startup_timeout_s)
            server_urls = servers.urls
        return http_manager(list(server_urls), pad_id=pad_id, config_dir=model_path, servers=servers)
    raise ValueError(f"rollout.name must be hf, builtin or sglang, not {name!r}")
