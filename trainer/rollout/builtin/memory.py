"""How many KV slots the built-in engine takes: sized from `gpu_memory_utilization`, as vLLM and SGLang do.

A slot holds one sequence's keys and values for the whole context (prompt + response), so the slot count
is the most sequences the engine decodes together. A fixed count either wastes memory (a small model on
an 80 GB GPU decodes only 256 sequences at a time) or runs out of it (a large model, a long context).
Instead the engine takes, at each allocation:

    budget = min(utilization x GPU memory - engine weights,  memory free now) - reserve
    slots  = budget // bytes per slot,  at most `cap`

"Free now" counts what the CUDA caching allocator holds unused, since torch can hand it out again. The
reserve covers what a decode or prefill step allocates besides the cache (prefill activations, cuBLAS
and CUDA-graph workspaces). Per slot: its keys and values in every layer, plus the decode buffers that
grow with the batch (the logits row in the engine's dtype and the sampler's fp32 copies of it).

Colocated with training, the engine allocates the cache when it is about to generate (trainer/workers):
whatever the trainer holds at that moment (weights, optimizer moments, a reference model) is simply
not free, so the cache never pushes the training step out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.rollout.builtin.model import ModelShape

MIN_RESERVE_BYTES = 512 * 2**20  # allocator fragmentation, cuBLAS / graph workspaces, sampling scratch
SAMPLER_FP32_COPIES = 2  # the sampler's float32 views of a logits row (scaled logits, probabilities)


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes of the GPU
    available: int  # bytes torch can allocate now: free on the device + cached by the allocator unused


def device_memory(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return DeviceMemory(total=total, available=free + cached_unused)


def slot_bytes(shape: ModelShape, context: int, dtype: torch.dtype) -> int:
    """Bytes one more slot costs: its KV cache in every layer plus its row of the decode buffers."""
    elem = torch.finfo(dtype).bits // 8
    kv = 2 * shape.layers * shape.kv_heads * context * shape.head_dim * elem
    rows = shape.vocab * (elem + 4 * SAMPLER_FP32_COPIES)
    return kv + rows


def reserve_bytes(shape: ModelShape, max_prefill_tokens: int, dtype: torch.dtype) -> int:
    """What a prefill of `max_prefill_tokens` allocates besides the cache (its widest activations)."""
    elem = torch.finfo(dtype).bits // 8
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    per_token = 3 * shape.intermediate + 8 * shape.hidden + 2 * qkv
    return MIN_RESERVE_BYTES + max_prefill_tokens * per_token * elem


def kv_slots(
    shape: ModelShape,
    *,
    context: int,
    dtype: torch.dtype,
    memory: DeviceMemory,
    utilization: float,
    weights_bytes: int,
    max_prefill_tokens: int,
    cap: int,
) -> int:
    """The slot count for the budget above (0 when even one slot does not fit)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    reserve = reserve_bytes(shape, max_prefill_tokens, dtype)
    budget = min(int(utilization * memory.total) - weights_bytes, memory.available) - reserve
    per_slot = slot_bytes(shape, context, dtype)
    # the cache has one scratch slot beyond the usable ones (the padding rows of a CUDA-graph bucket)
    return max(0, min(cap, budget // per_slot - 1))


def describe(memory: DeviceMemory, utilization: float, weights_bytes: int) -> str:
    gib = 2**30
    return (
        f"gpu_memory_utilization={utilization} of {memory.total / gib:.1f} GiB, engine weights "
        f"{weights_bytes / gib:.2f} GiB, {memory.available / gib:.1f} GiB free now"
    )
