"""Build the trainer's rollout engine from `actor_rollout_ref.rollout.name` (what the fit loop calls).

    hf       the reference transformers engine over the policy's own module (hf_engine.py)
    builtin  the built-in fast engine in this process, behind a RolloutManager (colocated)
    sglang   SGLang servers: the given URLs, or one `python -m sglang.launch_server` per GPU group,
             started here and stopped by close(); driven through the same RolloutManager

Every engine answers rollout/base.py's RolloutEngine protocol and has `pad_id` and `close()`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch

from trainer.rollout.base import RolloutEngine

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
    policy_model,
    tokenizer,
    model_path: str,
    context_length: int,
    max_running: int = 256,
    autocast_dtype: torch.dtype | None = None,
    server_urls: Sequence[str] = (),
    gpus: Sequence[str] = (),
    tp_size: int = 1,
    gpu_memory_utilization: float = SGLANG_MEMORY_FRACTION,
    startup_timeout_s: float = 900.0,
) -> RolloutEngine:
    """context_length: prompt + response tokens (data.max_prompt_length + data.max_response_length)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if name == "hf":
        from trainer.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(policy_model, tokenizer, autocast_dtype=autocast_dtype)
    if name == "builtin":
        from trainer.rollout.builtin import EngineConfig, load_engine
        from trainer.rollout.manager import local_manager

        device = next(policy_model.parameters()).device
        config = EngineConfig(max_running=max_running, context_length=context_length)
        engine = load_engine(policy_model, tokenizer=tokenizer, device=device, config=config)
        return local_manager(engine, tokenizer, pad_id=pad_id)
    if name == "sglang":
        from trainer.rollout.launcher import sglang_servers
        from trainer.rollout.manager import http_manager

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
