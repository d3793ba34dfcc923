"""Triton kernels of the GPU fast path: decode attention over slotted KV, and fused sampling.

Both are importable without a GPU (`TRITON_INTERPRET=1` runs them on CPU tensors, which is how the CPU
tests check them against the plain torch path); `triton_available()` says whether they can be used.

decode_attention: one program per (sequence, key-value head). It loads the Hq/Hkv query heads that
share that key-value head once, then streams the sequence's own keys and values, positions
[0, length) only, in blocks, with an online softmax (flash-decoding without the split: at the batch
sizes RL rollout runs, sequences x kv-heads already fills the GPU).

sample: one program per row of bf16 logits. In a single pass over the vocabulary it keeps a running
logsumexp of logits / T (for the logprob) and a running Gumbel-max key (for the sample), so no fp32
copy of the [B, V] logits is ever made. Noise is counter-based (Philox, keyed by a per-row seed), so a
sequence draws the same noise whatever batch it is in.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the plain torch path is used
    triton = tl = None


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device) -> bool:
    """Compiled kernels need CUDA; the interpreter (TRITON_INTERPRET=1) runs them on CPU tensors."""
    if triton is None:
        return False
    return device.type == "cuda" or INTERPRETED


if triton is not None:

    @triton.jit
    def _attend_block(
        q,
        k_ptr,
        v_ptr,
        base,
        start,
        length,
        stride_kt,
        sm_scale,
        best,
        total,
        acc,
        DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """One block of keys/values into the running (max, denominator, weighted sum) of each head."""
        dims = tl.arange(0, DIM)
        pos = start + tl.arange(0, BLOCK_N)
        visible = pos < length
        offsets = base + pos[:, None] * stride_kt + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=visible[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(visible[None, :], scores * sm_scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        rescale = tl.exp(best - new_best)
        p = tl.exp(scores - new_best[:, None])
        total = total * rescale + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets, mask=visible[:, None], other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        return new_best, total, acc

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        slots_ptr,
        lengths_ptr,
        sm_scale,
        stride_qb,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_kt,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        CONTEXT: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        length = tl.load(lengths_ptr + row).to(tl.int32)
        heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
        head_ok = tl.arange(0, GROUP_PAD) < GROUP
        dims = tl.arange(0, DIM)
        q = tl.load(
            q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None],
            other=0.0,
        )
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        base = slot * stride_ks + kv_head * stride_kh
        # Triton's CPU interpreter cannot loop to a bound loaded from memory: there, walk the whole
        # context (masked); compiled, stop at the sequence's own length.
        if INTERPRET:
            for start in range(0, CONTEXT, BLOCK_N):
                best, total, acc = _attend_block(
                    q,
                    k_ptr,
                    v_ptr,
                    base,
                    start,
                    length,
                    stride_kt,
                    sm_scale,
                    best,
                    total,
                    acc,
                    DIM,
                    BLOCK_N,
                    IEEE,
                )
        else:
            for start in range(0, length, BLOCK_N):
                best, total, acc = _attend_block(
                    q,
                    k_ptr,
                    v_ptr,
                    base,
                    start,
                    length,
                    stride_kt,
                    sm_scale,
                    best,
                    total,
                    acc,
                    DIM,
                    BLOCK_N,
                    IEEE,
                )
        out = acc / total[:, None]
        tl.store(
            out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None],
        )

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        stride_row,
        temperature_ptr,
        seed_ptr,
        threshold_ptr,
        slots_ptr,
        token_ptr,
        logprob_ptr,
        last_token_ptr,
        vocab: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_THRESHOLD: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature == 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / temperature)
        noise_scale = tl.where(greedy, 0.0, 1.0)
        seed = tl.load(seed_ptr + row)
        floor = float("-inf")
        if HAS_THRESHOLD:
            floor = tl.load(threshold_ptr + row)
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        best_key = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        base = logits_ptr + row * stride_row
        for start in range(0, vocab, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            ok = idx < vocab
            raw = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32)
            z = raw * inv_t
            # per-lane running logsumexp (lanes are combined after the loop)
            new_max = tl.maximum(run_max, z)
            seen = new_max > float("-inf")  # lanes past the vocabulary's end stay empty (and NaN-free)
            run_sum = tl.where(seen, run_sum * tl.exp(run_max - new_max) + tl.exp(z - new_max), 0.0)
            run_max = new_max
            u = tl.rand(seed, idx)
            gumbel = -tl.log(-tl.log(u))
            key = tl.where(ok & (raw >= floor), z + noise_scale * gumbel, float("-inf"))
            better = key > best_key  # strict: the earliest index wins ties, like torch.argmax
            best_idx = tl.where(better, idx, best_idx)
            best_key = tl.where(better, key, best_key)
        top = tl.max(run_max, 0)
        lse = top + tl.log(tl.sum(run_sum * tl.exp(run_max - top), 0))
        winner = tl.max(best_key, 0)
        # the smallest index among lanes holding the winning key
        token = tl.min(tl.where(best_key == winner, best_idx, vocab), 0)
        chosen = tl.load(base + token).to(tl.float32) * inv_t
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logprob_ptr + row, chosen - lse)
        slot = tl.load(slots_ptr + row)
        tl.store(last_token_ptr + slot, token.to(tl.int64))

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, eps, H: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr
    ):
        # transformers' order of roundings: residual + x rounded to the dtype, normalised in fp32,
        # rounded, then scaled by the weight and rounded again
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0)
        if ADD:
            total = x.to(tl.float32) + tl.load(residual_ptr + row * H + cols, mask=ok, other=0.0).to(
                tl.float32
            )
            x = total.to(x.dtype)
            tl.store(residual_ptr + row * H + cols, x, mask=ok)
        wide = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(wide * wide, 0) / H + eps)
        normed = (wide * scale).to(x.dtype).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * H + cols, (normed * weight).to(x.dtype), mask=ok)

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        slots_ptr,
        lengths_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_ks,
        stride_kh,
        stride_kt,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        DIM: tl.constexpr,
    ):
        # one program per (sequence, head of q, k or v): rotate q and k; write k and v into the cache
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half = tl.arange(0, DIM // 2)
        position = (tl.load(lengths_ptr + row) - 1).to(tl.int64)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        source = qkv_ptr + row * (HQ + 2 * HKV) * DIM + head * DIM
        x1 = tl.load(source + half).to(tl.float32)
        x2 = tl.load(source + DIM // 2 + half).to(tl.float32)
        if head < HQ + HKV:
            cos = tl.load(cos_ptr + position * DIM + half).to(tl.float32)
            sin = tl.load(sin_ptr + position * DIM + half).to(tl.float32)
            y1 = x1 * cos - x2 * sin
            y2 = x2 * cos + x1 * sin
        else:
            y1 = x1
            y2 = x2
        if head < HQ:
            target = q_ptr + row * HQ * DIM + head * DIM
        elif head < HQ + HKV:
            target = k_cache_ptr + slot * stride_ks + (head - HQ) * stride_kh + position * stride_kt
        else:
            target = v_cache_ptr + slot * stride_ks + (head - HQ - HKV) * stride_kh + position * stride_kt
        tl.store(target + half, y1.to(q_ptr.dtype.element_ty))
        tl.store(target + DIM // 2 + half, y2.to(q_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < INTER
        gate = tl.load(gate_up_ptr + row * 2 * INTER + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * INTER + INTER + cols, mask=ok, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * INTER + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """rms_norm(residual + x) with residual updated in place (residual None: rms_norm(x)). x [B, H]."""
    batch, hidden = x.shape
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(batch,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        eps,
        H=hidden,
        BLOCK=triton.next_power_of_2(hidden),
        ADD=residual is not None,
        num_warps=4,
    )
    return out


def rope_and_cache(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    slots: Tensor,
    lengths: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    heads: int,
    kv_heads: int,
) -> Tensor:
    """qkv [B, (Hq + 2 Hkv) D] -> RoPE'd q [B, Hq, D]; RoPE'd k and v go to the cache at lengths - 1."""
    batch = qkv.shape[0]
    dim = k_cache.shape[-1]
    q = torch.empty((batch, heads, dim), dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(batch, heads + 2 * kv_heads)](
        qkv,
        cos,
        sin,
        slots,
        lengths,
        q,
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=heads,
        HKV=kv_heads,
        DIM=dim,
        num_warps=1,
    )
    return q


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [B, 2I] -> silu(gate) * up [B, I]."""
    batch, width = gate_up.shape
    inter = width // 2
    out = torch.empty((batch, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(batch, triton.cdiv(inter, block))](gate_up, out, INTER=inter, BLOCK=block, num_warps=4)
    return out


ATTENTION_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}  # bench/rollout.py --tune times others


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor) -> Tensor:
    """q [B, Hq, D]; k/v cache [S, Hkv, Tmax, D] (last dim contiguous); slots, lengths [B] -> [B, Hq, D]."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    _decode_attention_kernel[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        slots,
        lengths,
        dim**-0.5,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        DIM=dim,
        IEEE=q.dtype == torch.float32,
        CONTEXT=k_cache.shape[2],
        INTERPRET=INTERPRETED,
        **ATTENTION_CONFIG,
    )
    return out


SAMPLE_CONFIG = {"BLOCK": 2048, "num_warps": 8}


def fused_sample(
    logits: Tensor,
    temperatures: Tensor,
    seeds: Tensor,
    thresholds: Tensor | None,
    slots: Tensor,
    last_token: Tensor,
) -> tuple[Tensor, Tensor]:
    """logits [B, V] (any float dtype) -> (tokens int64 [B], logprobs fp32 [B]).

    Also records last_token[slots] = tokens (the next decode step's input).
    """
    batch, vocab = logits.shape
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    _sample_kernel[(batch,)](
        logits,
        logits.stride(0),
        temperatures,
        seeds,
        thresholds if thresholds is not None else temperatures,
        slots,
        tokens,
        logprobs,
        last_token,
        vocab,
        HAS_THRESHOLD=thresholds is not None,
        BLOCK=min(SAMPLE_CONFIG["BLOCK"], triton.next_power_of_2(vocab)),
        num_warps=SAMPLE_CONFIG["num_warps"],
    )
    return tokens, logprobs
