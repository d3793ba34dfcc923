"""Sampling for the built-in engine: per-row temperature, top-k, top-p and seed; the sampled token's logprob.

The logprob is log_softmax(logits / T) at the sampled token, before top-k / top-p truncation (the
convention of trainer/rollout/base.py, and SGLang's default); greedy rows (T = 0) report it under T = 1.

Sampling is by inverse CDF: one uniform u per row, drawn from a seed that depends only on the sequence
and the index of the token being generated, picks the first entry whose cumulative probability (over
the entries top-k / top-p keep, renormalised) exceeds u. So a sequence samples the same tokens whether
it runs alone or inside any batch (up to the numerics of the forward). Top-k / top-p become a per-row
floor on the raw logits: entries below it cannot be drawn.

Two implementations of the same rule: the Triton kernel (kernels.fused_sample, GPU: two passes over the
bf16 logits, no fp32 copy, Philox for u) and `torch_sample` (CPU, a torch.Generator for u; the reference
the kernel is tested against). They draw different u for the same seed, so CPU and GPU runs differ.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from trainer.rollout.builtin import kernels

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_A, _MIX_B = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def token_seeds(base_seeds: np.ndarray, token_index: np.ndarray) -> np.ndarray:
    """splitmix64(base + (index + 1) * golden) -> non-negative int64 seeds, one per row."""
    with np.errstate(over="ignore"):
        z = base_seeds.astype(np.uint64) + (token_index.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX_A
        z = (z ^ (z >> np.uint64(27))) * _MIX_B
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(1)).astype(np.int64)


def needs_floor(top_k: np.ndarray, top_p: np.ndarray, vocab: int) -> bool:
    return bool(((top_k > 0) & (top_k < vocab)).any() or (top_p < 1.0).any())


def sampling_floors(logits: Tensor, temperatures: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The smallest raw logit each row may still draw after top-k then top-p ([B] fp32; -inf: no limit).

    top-k keeps the k largest logits; top-p then keeps the smallest prefix of those (by probability
    under logits / T, renormalised) whose mass reaches p. Ties at the floor are kept.
    """
    vocab = logits.shape[-1]
    # every row, the unlimited ones masked at the end: selecting the limited rows (nonzero) would make
    # the host wait for the step's forward, and callers use one sampling setting for a whole batch anyway
    k_limited = (top_k > 0) & (top_k < vocab)
    temps = torch.where(temperatures == 0, 1.0, temperatures.float())
    scaled = logits.float() / temps[:, None]
    ordered, _ = scaled.sort(dim=-1, descending=True)
    k = torch.where(k_limited, top_k, vocab).long()
    rank = torch.arange(vocab, device=logits.device)[None, :]
    ordered = ordered.masked_fill(rank >= k[:, None], float("-inf"))  # top-k
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly better entries
    keep = (mass_before < top_p[:, None].float()) & (rank < k[:, None])
    last_kept = keep.sum(dim=-1) - 1  # >= 0: the best entry always survives
    floor_scaled = ordered.gather(-1, last_kept[:, None]).squeeze(-1)
    floors = floor_scaled * temps  # back to raw-logit units
    return torch.where(k_limited | (top_p < 1.0), floors, float("-inf"))


def torch_sample(
    logits: Tensor, temperatures: Tensor, seeds: Tensor, floors: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The reference rule on any device: logits [B, V] -> (tokens int64 [B], logprobs fp32 [B])."""
    greedy = temperatures == 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperatures.float())[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    uniform = torch.tensor(
        [torch.rand(1, generator=torch.Generator().manual_seed(int(seed))).item() for seed in seeds.tolist()],
        device=logits.device,
    )
    mass = torch.exp(scaled - scaled.max(dim=-1, keepdim=True).values)
    if floors is not None:
        mass = mass.masked_fill(logits.float() < floors[:, None], 0.0)
    cumulative = mass.cumsum(dim=-1)
    target = uniform * cumulative[:, -1]
    sampled = (cumulative <= target[:, None]).sum(dim=-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def sample(
    logits: Tensor,
    temperatures: Tensor,
    seeds: Tensor,
    floors: Tensor | None,
    slots: Tensor,
    last_token: Tensor,
    *,
    fused: bool,
    all_greedy: bool = False,
) -> tuple[Tensor, Tensor]:
    """Sample every row and record each row's token as its slot's latest (last_token[slots])."""
    if fused:
        return kernels.fused_sample(logits, temperatures, seeds, floors, slots, last_token, all_greedy)
    tokens, logprobs = torch_sample(logits, temperatures, seeds, floors)
    last_token[slots] = tokens
    return tokens, logprobs
