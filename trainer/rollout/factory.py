"""The run's rollout manager from `actor_rollout_ref.rollout.name`: one RolloutManager in every case.

hf       transformers generate on each policy rank, next to its model (trainer/workers/engines.py)
builtin  the built-in fast engine on each policy rank, next to its model
sglang   SGLang servers: the given URLs, or one `python -m sglang.launch_server` per GPU group,
         started here and stopped by close()

SGLang servers load new weights from a checkpoint folder (/update_weights_from_disk). Servers on other
machines (ROLLOUT_SERVER_URLS) can read it only from a shared filesystem: ROLLOUT_WEIGHTS_DIR names
that folder (default: a temporary folder on this machine, fine for servers started here).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit
from typing import Literal

import torch

from trainer.rollout.manager import RolloutManager, http_manager
from trainer.rollout.pool import ReplicaPool

RolloutName = Literal["hf", "builtin", "sglang"]
log = logging.getLogger(__name__)

URLS_ENV = "ROLLOUT_SERVER_URLS"  # comma-separated, like the services' *_URL variables
WEIGHTS_DIR_ENV = "ROLLOUT_WEIGHTS_DIR"  # where weight checkpoints for the servers go (a shared path)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})
# The share of a GPU a started SGLang server takes (verl's rollout.gpu_memory_utilization default), so a
# trainer on the same GPU keeps the rest.
SGLANG_MEMORY_FRACTION = 0.5


def server_urls_from_env() -> list[str]:
    return [url.strip() for url in os.environ.get(URLS_ENV, "").split(",") if url.strip()]


def weights_dir_from_env() -> str | None:
    return os.environ.get(WEIGHTS_DIR_ENV, "").strip() or None


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
    seeded: bool = True,
    weights_dir: str | None = None,
    startup_timeout_s: float = 900.0,
) -> RolloutManager:
    """The run's rollout manager: over the policy ranks' colocated engines (`replicas`: hf, builtin), or
    over SGLang servers (the given URLs, or one started per GPU group here and stopped by close()).
    `seeded`: the loop sends sampling_seed (it always does), so started SGLang servers run with
    --enable-deterministic-inference; servers given by URL are checked by the client instead.
    `weights_dir`: the folder weight checkpoints for the servers are written to (created here)."""
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
                model_path,
                list(gpus),
                tp_size=tp_size,
                mem_fraction_static=gpu_memory_utilization,
                deterministic_inference=seeded,
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
            list(server_urls), pad_id=pad_id, config_dir=model_path, servers=servers, weights_dir=weights_dir
        )
    raise ValueError(f"rollout.name must be hf, builtin or sglang, not {name!r}")
