"""The rollout engine each policy rank runs next to its model (colocated, as verl's hybrid engine), as a
replica of the driver's rollout manager (trainer/rollout/manager.py).

    builtin  the built-in fast engine (trainer/rollout/builtin: continuous batching, CUDA graphs, Triton)
             on its own copy of the weights (bf16 on CUDA), on its own thread: LocalReplica
    hf       transformers generate on a copy of the model: HFReplica, which gathers the requests that
             arrive together into one generate call

Both answer the replica calls the manager makes (rollouts, memory release / resume) in this process,
and `load_weights_now(named tensors)`, which the rank's weight sync calls tensor bucket by bucket.

Memory: the built-in engine's KV cache is allocated only between the driver's resume_memory and
release_memory around each rollout phase (SGLang's memory tags), sized from
rollout.gpu_memory_utilization and what is free then (trainer/rollout/builtin/memory.py), so the
old-logprob, reference and update passes have that memory, in this process's allocator (they are this
process: trainer/parallel/placement.py; rollout.free_cache_engine=false keeps it from the first phase
on). The weights stay on the GPU: the sync after each update copies into them in place.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal

import torch

log = logging.getLogger(__name__)
KV_CACHE = ("kv_cache",)  # SGLang's memory tag of the KV cache (weights are "weights")
# the most KV slots the built-in engine sizes itself to: decoding more sequences at once gains little,
# and the logits buffers of the decode step grow with the slot count
MAX_SLOTS = 2048
CPU_SLOTS = 256  # the same cap on the CPU


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The colocated rollout engine of a policy rank (actor_rollout_ref.rollout.*)."""

    name: Literal["builtin", "hf"] = "builtin"
    context_length: int = 4096  # prompt + response tokens (rollout.prompt_length + response_length)
    gpu_memory_utilization: float = 0.5  # builtin on CUDA: weights + KV cache take at most this share
    # builtin was not asked for by name (rollout.name auto, or vllm): a model it cannot run (another
    # architecture, a scaled RoPE as Llama 3's, sliding windows) generates with hf, said in a warning
    hf_if_refused: bool = False


def colocated_replica(
    settings: EngineSettings,
    model: torch.nn.Module,
    tokenizer,
    *,
    device: torch.device,
    model_path: str,
    trust_remote_code: bool,
    name: str,
):
    """The rank's engine as a replica, its weights copied from `model` (builtin) or read from
    `model_path` (hf); bf16 on CUDA, fp32 on the CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if settings.name == "builtin" and settings.hf_if_refused and (refused := builtin_refuses(model)):
        log.warning(
            "%s; transformers (hf) generates instead, slower (rollout.name=builtin stops here)", refused
        )
        settings = dataclasses.replace(settings, name="hf")
    if settings.name == "hf":
        from trainer.model import load_reference
        from trainer.rollout.hf_engine import HFReplica, HFRolloutEngine

        copy = load_reference(
            model_path, device=device, param_dtype=dtype, trust_remote_code=trust_remote_code
        )
        return HFReplica(HFRolloutEngine(copy, tokenizer), name=name)
    from trainer.rollout.builtin import EngineConfig, load_engine
    from trainer.rollout.builtin.worker import EngineWorker
    from trainer.rollout.local import LocalReplica

    on_gpu = device.type == "cuda"
    config = EngineConfig(
        max_running=MAX_SLOTS if on_gpu else CPU_SLOTS,
        context_length=settings.context_length,
        gpu_memory_utilization=settings.gpu_memory_utilization if on_gpu else None,
        # the colocated roles are this process (trainer/parallel/placement.py): the KV memory released
        # stays in its allocator for their passes rather than going back to the device
        keep_released_memory=True,
    )
    engine = load_engine(model, tokenizer=tokenizer, dtype=dtype, device=device, config=config)
    engine.release(KV_CACHE)  # held only through the rollout phase (the driver resumes it)
    return LocalReplica(EngineWorker(engine), tokenizer, name=name, with_text=False)


def builtin_refuses(model: torch.nn.Module) -> str | None:
    """Why the built-in engine cannot run this transformers model (None: it can)."""
    from trainer.rollout.builtin.model import ModelShape

    try:
        ModelShape.from_config(model.config)
    except ValueError as refused:
        return str(refused)
    return None
