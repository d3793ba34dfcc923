"""Triton kernels of the GPU fast path. Importable without a GPU: `TRITON_INTERPRET=1` runs them on CPU
tensors, which is how the CPU tests check them against the plain torch path they replace.

decode_attention (flash-decoding): one program per (sequence, key-value head, split of the sequence).
It loads the Hq/Hkv query heads that share the key-value head once, then streams its share of the
sequence's own keys and values, positions [0, length) only, with an online softmax; a second kernel
merges the splits. Splitting gives each program one or two blocks of keys: at rollout batch sizes the
cost is latency (dependent loads), not bandwidth, so more, shorter programs finish sooner.

sample: two passes over a row of bf16 logits. The first, one program per split of the vocabulary (16
a row), keeps running sums of exp(logits / T) (all entries: the logsumexp for the logprob; entries above
the top-k / top-p floor: the sampling mass) and the argmax; the second, one program per row, combines
the splits, finds the split where a uniform draw u falls in the cumulative kept mass, and walks that
split alone to the entry u picks (inverse CDF). One program a row walking all 151,936 entries twice
took ~190 us a decode step at batch 256 on an H200 (a tenth of the step), the vocabulary read serially.
No fp32 copy of the [B, V] logits is made, and one random number per row replaces a Gumbel noise per
vocabulary entry. u is counter-based (Philox, keyed by a per-row seed), so a sequence draws the same u
whatever batch it is in.

add_rms_norm, rope_and_cache, silu_mul: the elementwise work between the matmuls of a layer, fused
(transformers' order of roundings between them; each kernel computes in fp32 and rounds once).
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
ATTENTION_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}  # bench/rollout.py --tune times others
SAMPLE_CONFIG = {"BLOCK": 2048, "num_warps": 8, "SPLITS": 16}


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
        lo,
        hi,
        stride_kt,
        sm_scale,
        best,
        total,
        acc,
        DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Keys/values [start, start + BLOCK_N) ∩ [lo, hi) into each head's running (max, sum, acc)."""
        dims = tl.arange(0, DIM)
        pos = start + tl.arange(0, BLOCK_N)
        visible = (pos >= lo) & (pos < hi)
        offsets = base + pos[:, None] * stride_kt + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=visible[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(visible[None, :], scores * sm_scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        anchor = tl.where(new_best == float("-inf"), 0.0, new_best)  # an all-masked block stays NaN-free
        rescale = tl.exp(best - anchor)
        p = tl.exp(scores - anchor[:, None])
        total = total * rescale + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets, mask=visible[:, None], other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        return new_best, total, acc

    # The kernel's long argument lists, a few to a line:
    # fmt: off
    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_stat_ptr, slots_ptr, lengths_ptr,
        sm_scale, stride_ks, stride_kh, stride_kt,
        HQ: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
        SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, CONTEXT: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        length = tl.load(lengths_ptr + row).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, length)
        group = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + group
        head_ok = group < GROUP
        dims = tl.arange(0, DIM)
        q = tl.load(
            q_ptr + (row * HQ + heads[:, None]) * DIM + dims[None, :], mask=head_ok[:, None], other=0.0
        )
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        base = slot * stride_ks + kv_head * stride_kh
        # Triton's CPU interpreter cannot loop to a bound loaded from memory: there, walk the whole
        # context (masked to [lo, hi)); compiled, visit [lo, hi) only.
        if INTERPRET:
            first, last = 0, CONTEXT
        else:
            first, last = lo, hi
        for start in range(first, last, BLOCK_N):
            best, total, acc = _attend_block(
                q, k_ptr, v_ptr, base, start, lo, hi, stride_kt, sm_scale, best, total, acc,
                DIM, BLOCK_N, IEEE,
            )
        _store_attention(
            out_ptr, part_acc_ptr, part_stat_ptr, row, heads, head_ok, split, best, total, acc,
            HQ, DIM, SPLITS,
        )
    # fmt: on

    @triton.jit
    def _store_attention(
        out_ptr,
        part_acc_ptr,
        part_stat_ptr,
        row,
        heads,
        head_ok,
        split,
        best,
        total,
        acc,
        HQ: tl.constexpr,
        DIM: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """One split's result: the output itself, or its partials for the merge kernel."""
        dims = tl.arange(0, DIM)
        if SPLITS == 1:
            out = acc / total[:, None]
            target = out_ptr + (row * HQ + heads[:, None]) * DIM + dims[None, :]
            tl.store(target, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        else:  # partials [B, Hq, SPLITS, D] and (max, sum) [B, Hq, SPLITS, 2], merged by the next kernel
            part = (row * HQ + heads) * SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * DIM + dims[None, :], acc, mask=head_ok[:, None])
            tl.store(part_stat_ptr + part * 2, best, mask=head_ok)
            tl.store(part_stat_ptr + part * 2 + 1, total, mask=head_ok)

    @triton.jit
    def _merge_splits_kernel(
        part_acc_ptr,
        part_stat_ptr,
        out_ptr,
        HQ: tl.constexpr,
        HQ_PAD: tl.constexpr,
        DIM: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HQ_PAD)
        ok = heads < HQ
        dims = tl.arange(0, DIM)
        top = tl.full([HQ_PAD], float("-inf"), tl.float32)
        for split in tl.static_range(SPLITS):
            part = (row * HQ + heads) * SPLITS + split
            top = tl.maximum(top, tl.load(part_stat_ptr + part * 2, mask=ok, other=float("-inf")))
        total = tl.zeros([HQ_PAD], tl.float32)
        acc = tl.zeros([HQ_PAD, DIM], tl.float32)
        for split in tl.static_range(SPLITS):
            part = (row * HQ + heads) * SPLITS + split
            weight = tl.exp(tl.load(part_stat_ptr + part * 2, mask=ok, other=float("-inf")) - top)
            total += weight * tl.load(part_stat_ptr + part * 2 + 1, mask=ok, other=0.0)
            acc += weight[:, None] * tl.load(
                part_acc_ptr + part[:, None] * DIM + dims[None, :], mask=ok[:, None], other=0.0
            )
        out = acc / tl.where(ok, total, 1.0)[:, None]
        target = out_ptr + (row * HQ + heads[:, None]) * DIM + dims[None, :]
        tl.store(target, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])

    @triton.jit
    def _inverse_cdf(base, begin, end, target, floor, inv_t, top, fallback, BLOCK: tl.constexpr):
        """Pass 2 of sampling over columns [begin, end): the first kept entry whose cumulative mass
        (exp(z - top)) exceeds target."""
        running = target * 0.0
        sampled = fallback
        for start in range(begin, end, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            raw = tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
            mass = tl.where(raw >= floor, tl.exp(raw * inv_t - top), 0.0)
            cumulative = running + tl.cumsum(mass, 0)
            # The block's end is read off the same scan that picks the entry: a tree-reduced tl.sum
            # rounds differently, and when it said "the target falls in this block" while the scan
            # ended a hair below it, no entry qualified and the kernel wrote one past the columns (a
            # device-side assert at the next step's embedding lookup, once in millions of draws). The
            # last kept entry stays as the pick for any rounding left over.
            block_end = tl.max(cumulative, 0)
            first = tl.min(tl.where((cumulative > target) & (mass > 0), idx, end), 0)
            last_kept = tl.max(tl.where(mass > 0, idx, -1), 0)
            candidate = tl.where(first < end, first, last_kept)
            crossing = (running <= target) & (block_end > target)
            sampled = tl.where(crossing, candidate, sampled)
            running = block_end
        return sampled

    @triton.jit
    def _row_sampling(temperature_ptr, floor_ptr, row, HAS_FLOOR: tl.constexpr):
        """A row's (greedy, 1 / T (1 when greedy), top-k / top-p floor on the raw logits)."""
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature == 0.0
        floor = float("-inf")
        if HAS_FLOOR:
            floor = tl.load(floor_ptr + row)
        return greedy, tl.where(greedy, 1.0, 1.0 / temperature), floor

    @triton.jit
    def _sample_partials_kernel(
        logits_ptr,
        stride_row,
        temperature_ptr,
        floor_ptr,
        max_ptr,
        all_ptr,
        kept_ptr,
        best_ptr,
        vocab: tl.constexpr,
        CHUNK: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_FLOOR: tl.constexpr,
    ):
        """Pass 1 over one split of a row: the split's max of z = logits / T, its sums of exp(z - max)
        over all and over kept entries, and its argmax."""
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        _, inv_t, floor = _row_sampling(temperature_ptr, floor_ptr, row, HAS_FLOOR)
        base = logits_ptr + row * stride_row
        begin = split * CHUNK
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_all = tl.zeros([BLOCK], tl.float32)
        lane_kept = tl.zeros([BLOCK], tl.float32)
        lane_best = tl.zeros([BLOCK], tl.int32)
        for start in range(0, CHUNK, BLOCK):
            idx = begin + start + tl.arange(0, BLOCK)
            ok = idx < vocab
            raw = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32)
            z = raw * inv_t
            new_max = tl.maximum(lane_max, z)
            anchor = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(lane_max - anchor)
            e = tl.exp(z - anchor)
            lane_all = lane_all * rescale + e
            lane_kept = lane_kept * rescale + tl.where(raw >= floor, e, 0.0)
            lane_best = tl.where(z > lane_max, idx, lane_best)  # strict: the earliest index wins ties
            lane_max = new_max
        top = tl.max(lane_max, 0)
        anchor = tl.where(top == float("-inf"), 0.0, top)
        weight = tl.exp(lane_max - anchor)
        out = row * SPLITS + split
        tl.store(max_ptr + out, top)
        tl.store(all_ptr + out, tl.sum(lane_all * weight, 0))
        tl.store(kept_ptr + out, tl.sum(lane_kept * weight, 0))
        tl.store(best_ptr + out, tl.min(tl.where(lane_max == top, lane_best, vocab), 0))

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        stride_row,
        temperature_ptr,
        seed_ptr,
        floor_ptr,
        slots_ptr,
        token_ptr,
        logprob_ptr,
        last_token_ptr,
        max_ptr,
        all_ptr,
        kept_ptr,
        best_ptr,
        vocab: tl.constexpr,
        CHUNK: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_FLOOR: tl.constexpr,
        ALL_GREEDY: tl.constexpr,
    ):
        """The row's splits combined: logsumexp and argmax; then the draw, whose split is found from the
        splits' kept masses, and whose entry from a scan of that split alone."""
        row = tl.program_id(0).to(tl.int64)
        greedy, inv_t, floor = _row_sampling(temperature_ptr, floor_ptr, row, HAS_FLOOR)
        base = logits_ptr + row * stride_row
        splits = tl.arange(0, SPLITS_P2)
        valid = splits < SPLITS
        maxima = tl.load(max_ptr + row * SPLITS + splits, mask=valid, other=float("-inf"))
        top = tl.max(maxima, 0)
        weight = tl.where(valid, tl.exp(maxima - top), 0.0)
        totals = tl.load(all_ptr + row * SPLITS + splits, mask=valid, other=0.0) * weight
        lse = top + tl.log(tl.sum(totals, 0))
        best = tl.load(best_ptr + row * SPLITS + splits, mask=valid, other=vocab)
        token = tl.min(tl.where(maxima == top, best, vocab), 0)
        if not ALL_GREEDY:
            draws = tl.rand(tl.load(seed_ptr + row), tl.arange(0, 2))
            u = tl.sum(tl.where(tl.arange(0, 2) == 0, draws, 0.0), 0)
            kept = tl.load(kept_ptr + row * SPLITS + splits, mask=valid, other=0.0) * weight
            cumulative = tl.cumsum(kept, 0)
            target = u * tl.max(cumulative, 0)  # u of the kept mass (the scan's end, as in the split)
            # the split the target falls in: the first whose running mass passes it (else, by rounding,
            # the last split with kept mass); its argmax is kept (>= the floor), so it is the fallback
            chosen = tl.min(tl.where((cumulative > target) & (kept > 0), splits, SPLITS_P2), 0)
            last_kept = tl.max(tl.where(kept > 0, splits, -1), 0)
            chosen = tl.maximum(tl.where(chosen < SPLITS_P2, chosen, last_kept), 0)
            before = tl.sum(tl.where(splits == chosen, cumulative - kept, 0.0), 0)
            fallback = tl.sum(tl.where(splits == chosen, best, 0), 0)
            fallback = tl.where(last_kept >= 0, fallback, token)  # nothing kept: the argmax, as before
            begin = chosen * CHUNK
            end = tl.minimum(begin + CHUNK, vocab)
            sampled = _inverse_cdf(base, begin, end, target - before, floor, inv_t, top, fallback, BLOCK)
            token = tl.where(greedy, token, sampled)
        chosen_logit = tl.load(base + token).to(tl.float32) * inv_t
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logprob_ptr + row, chosen_logit - lse)
        tl.store(last_token_ptr + tl.load(slots_ptr + row), token.to(tl.int64))

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
        HEADS_PAD: tl.constexpr,
    ):
        # one program per token, all its heads: rotate q and k; q to its own tensor, k and v to the cache
        row = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        half = tl.arange(0, DIM // 2)[None, :]
        real = heads < HQ + 2 * HKV
        position = (tl.load(lengths_ptr + row) - 1).to(tl.int64)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        source = qkv_ptr + row * (HQ + 2 * HKV) * DIM + heads * DIM + half
        x1 = tl.load(source, mask=real, other=0.0).to(tl.float32)
        x2 = tl.load(source + DIM // 2, mask=real, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + position * DIM + half).to(tl.float32)
        sin = tl.load(sin_ptr + position * DIM + half).to(tl.float32)
        rotate = heads < HQ + HKV
        y1 = tl.where(rotate, x1 * cos - x2 * sin, x1).to(q_ptr.dtype.element_ty)
        y2 = tl.where(rotate, x2 * cos + x1 * sin, x2).to(q_ptr.dtype.element_ty)
        is_q = heads < HQ
        is_k = (heads >= HQ) & rotate
        is_v = (heads >= HQ + HKV) & real
        q_target = q_ptr + row * HQ * DIM + heads * DIM + half
        tl.store(q_target, y1, mask=is_q)
        tl.store(q_target + DIM // 2, y2, mask=is_q)
        cache = slot * stride_ks + position * stride_kt + half
        k_target = k_cache_ptr + cache + (heads - HQ) * stride_kh
        tl.store(k_target, y1, mask=is_k)
        tl.store(k_target + DIM // 2, y2, mask=is_k)
        v_target = v_cache_ptr + cache + (heads - HQ - HKV) * stride_kh
        tl.store(v_target, y1, mask=is_v)
        tl.store(v_target + DIM // 2, y2, mask=is_v)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < INTER
        gate = tl.load(gate_up_ptr + row * 2 * INTER + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * INTER + INTER + cols, mask=ok, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * INTER + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def attention_splits(context: int) -> int:
    """Splits per sequence: about one 128-position chunk per program, at most 8."""
    return max(1, min(8, -(-context // 128)))


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, splits: int | None = None
) -> Tensor:
    """q [B, Hq, D] (contiguous); k/v cache [S, Hkv, Tmax, D]; slots, lengths [B] -> [B, Hq, D]."""
    batch, heads, dim = q.shape
    kv_heads, context = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    splits = splits or attention_splits(context)
    q = q.contiguous()
    out = torch.empty_like(q)
    part_acc = part_stat = out  # unused with one split
    if splits > 1:
        part_acc = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=q.device)
        part_stat = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_stat,
        slots,
        lengths,
        dim**-0.5,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        DIM=dim,
        SPLITS=splits,
        IEEE=q.dtype == torch.float32,
        CONTEXT=context,
        INTERPRET=INTERPRETED,
        **ATTENTION_CONFIG,
    )
    if splits > 1:
        _merge_splits_kernel[(batch,)](
            part_acc,
            part_stat,
            out,
            HQ=heads,
            HQ_PAD=triton.next_power_of_2(heads),
            DIM=dim,
            SPLITS=splits,
            num_warps=4,
        )
    return out


def fused_sample(
    logits: Tensor,
    temperatures: Tensor,
    seeds: Tensor,
    floors: Tensor | None,
    slots: Tensor,
    last_token: Tensor,
    all_greedy: bool = False,
) -> tuple[Tensor, Tensor]:
    """logits [B, V] (any float dtype) -> (tokens int64 [B], logprobs fp32 [B]).

    Also records last_token[slots] = tokens (the next decode step's input). all_greedy: every
    temperature is 0 (the caller knows; the sampling pass is skipped).
    """
    batch, vocab = logits.shape
    device = logits.device
    block = min(SAMPLE_CONFIG["BLOCK"], triton.next_power_of_2(vocab))
    chunk = triton.cdiv(triton.cdiv(vocab, SAMPLE_CONFIG["SPLITS"]), block) * block
    splits = triton.cdiv(vocab, chunk)
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    maxima, totals, kept = (torch.empty(batch, splits, dtype=torch.float32, device=device) for _ in range(3))
    best = torch.empty(batch, splits, dtype=torch.int32, device=device)
    common = dict(vocab=vocab, CHUNK=chunk, SPLITS=splits, BLOCK=block, HAS_FLOOR=floors is not None)
    floors = floors if floors is not None else temperatures  # not read without HAS_FLOOR
    _sample_partials_kernel[(batch, splits)](
        logits, logits.stride(0), temperatures, floors, maxima, totals, kept, best,
        num_warps=SAMPLE_CONFIG["num_warps"], **common,
    )  # fmt: skip
    _sample_kernel[(batch,)](
        logits, logits.stride(0), temperatures, seeds, floors, slots, tokens, logprobs, last_token,
        maxima, totals, kept, best, SPLITS_P2=triton.next_power_of_2(splits), ALL_GREEDY=all_greedy,
        num_warps=SAMPLE_CONFIG["num_warps"], **common,
    )  # fmt: skip
    return tokens, logprobs


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
    _rope_cache_kernel[(batch,)](
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
        HEADS_PAD=triton.next_power_of_2(heads + 2 * kv_heads),
        num_warps=2,
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
