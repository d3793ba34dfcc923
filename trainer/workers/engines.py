"""The rollout engine that runs next to the policy on its GPU (colocated, as verl's hybrid engine).

    builtin  the built-in fast engine (trainer/rollout/builtin: continuous batching, CUDA graphs, Triton)
             on its own bf16 copy of the weights, behind an in-process RolloutManager; the weights reach
             it tensor by tensor (`load_weights` takes any subset of the named tensors)
    hf       transformers generate: over the policy's own module in one process (nothing to copy), over
             a bf16 copy in a Ray rank

Memory: the KV cache exists only while the engine generates (`KVWhileGenerating`). It is allocated
when generation starts, sized from rollout.gpu_memory_utilization and what is free at that moment
(trainer/rollout/builtin/memory.py), and released as soon as the rollouts are out, so the old-logprob,
reference and policy-update passes that follow have the memory back. The weights stay on the GPU: the
sync after each update copies into them in place.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from trainer.rollout.base import Rollout, SamplingParams

log = logging.getLogger("trainer")

KV_CACHE = ("kv_cache",)  # SGLang's memory tag of the KV cache (weights are "weights")
# the most KV slots the built-in engine sizes itself to: decoding more sequences at once gains little,
# and the logits buffers of the decode step grow with the slot count
MAX_SLOTS = 2048


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The colocated rollout engine of a policy rank (actor_rollout_ref.rollout.*)."""

    name: Literal["builtin", "hf"] = "builtin"
    context_length: int = 4096  # prompt + response tokens (rollout.prompt_length + response_length)
    gpu_memory_utilization: float = 0.5  # builtin on CUDA: weights + KV cache take at most this share
    max_slots: int = MAX_SLOTS  # builtin: the cap on memory-sized KV slots (CPU: exactly this many)
    max_batch_size: int | None = None  # hf: sequences decoded together (None: all)


class KVWhileGenerating:
    """An engine with SGLang's memory tags whose KV cache is allocated for each generate() call only.

    The loop's release_memory / resume_memory are no-ops: between generate() calls nothing is held.
    """

    def __init__(self, engine, dtype: torch.dtype) -> None:
        """dtype: the engine's weights' (what the weight sync casts to)."""
        self.engine, self.dtype = engine, dtype
        self.pad_id = engine.pad_id
        engine.release_memory(KV_CACHE)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        self.engine.resume_memory(KV_CACHE)
        try:
            rollouts = self.engine.generate(prompt_ids, sampling)
        except BaseException:
            try:
                self.engine.release_memory(KV_CACHE)
            except Exception as exc:  # noqa: BLE001 - keep the generate() error, say the release failed
                log.warning("could not release the KV cache after a failed generate: %s", exc)
            raise
        self.engine.release_memory(KV_CACHE)
        return rollouts

    def load_weights(self, state_dict_or_model) -> None:
        self.engine.load_weights(state_dict_or_model)

    def release_memory(self) -> None:
        """Already released: the cache lives inside generate() only."""

    def resume_memory(self) -> None:
        """generate() allocates the cache itself."""

    def close(self) -> None:
        self.engine.close()


def builtin_engine(
    model: torch.nn.Module,
    tokenizer,
    *,
    device: torch.device,
    context_length: int,
    gpu_memory_utilization: float,
    max_slots: int = MAX_SLOTS,
    pad_id: int,
) -> KVWhileGenerating:
    """The built-in engine on `device`, filled from `model`'s weights (any device, any dtype).

    bf16 on CUDA, fp32 on CPU. CPU engines get `max_slots` slots (no memory to size them from).
    """
    from trainer.rollout.builtin import EngineConfig, load_engine
    from trainer.rollout.manager import local_manager

    on_gpu = device.type == "cuda"
    config = EngineConfig(
        max_running=max_slots if on_gpu else min(max_slots, 256),
        context_length=context_length,
        gpu_memory_utilization=gpu_memory_utilization if on_gpu else None,
    )
    dtype = torch.bfloat16 if on_gpu else torch.float32
    engine = load_engine(model, tokenizer=tokenizer, dtype=dtype, device=device, config=config)
    return KVWhileGenerating(local_manager(engine, tokenizer, pad_id=pad_id), dtype)


def hf_engine_copy(path: str, tokenizer, *, device: torch.device, trust_remote_code: bool, max_batch_size):
    """transformers generate on a copy of the model at `path` (bf16 on CUDA), taking weights by name."""
    from trainer.model import load_reference
    from trainer.rollout.hf_engine import HFRolloutEngine

    class CopiedHFEngine(HFRolloutEngine):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

        def load_weights(self, named) -> None:
            copy_named_tensors(self.model, named)

    model = load_reference(
        path, device=device, param_dtype=CopiedHFEngine.dtype, trust_remote_code=trust_remote_code
    )
    return CopiedHFEngine(model, tokenizer, max_batch_size=max_batch_size)


def copy_named_tensors(model: torch.nn.Module, named: Mapping[str, torch.Tensor]) -> None:
    """Copy some of a model's tensors in place, by state-dict name (a partial load_state_dict)."""
    state = model.state_dict(keep_vars=True)
    unknown = sorted(set(named) - set(state))
    if unknown:
        raise KeyError(f"the engine's model has no tensors named {unknown[:5]}")
    with torch.no_grad():
        for name, tensor in named.items():
            state[name].copy_(tensor)
