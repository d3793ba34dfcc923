"""The built-in engine's decode matmuls at rollout batch sizes: cuBLAS (torch) against Triton tiles.

A decode step of the Qwen2.5-0.5B shape at batch 256 spends ~1 ms of its ~1.9 ms in five matmuls a
layer and the LM head, each a skinny [B, K] x [K, N]. This times each shape alone, under a CUDA graph (as
the engine runs them), for:

- `torch`: F.linear(x, W) with W [N, K], what the engine does;
- `torch-kn`: x @ W' with W' stored [K, N] (cuBLAS picks other kernels for the other layout);
- `triton`: a plain tiled Triton matmul over a few tile shapes (the best printed);
- for the down projection, `triton+silu`: the SiLU-and-multiply of the gate-up output computed while
  loading the matmul's left operand (one kernel less a layer, and the [B, I] intermediate never written).

    python bench/decode_gemm.py [--batches 64,256,512] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HIDDEN, INTER, VOCAB, Q_OUT, KV_OUT = 896, 4864, 151936, 896, 128


@triton.jit
def _matmul_kernel(
    a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_wn, stride_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_A: tl.constexpr,
):  # fmt: skip
    """C [M, N] = A [M, K] @ W [N, K]^T (+ bias); SILU_A: A is gate-up [M, 2K], the operand silu(g) * u."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    inner = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for start in range(0, K, BK):
        ks = start + inner
        a_mask = (rows[:, None] < M) & (ks[None, :] < K)
        a_at = a_ptr + rows[:, None] * stride_am + ks[None, :]
        if SILU_A:
            gate = tl.load(a_at, mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(a_at + K, mask=a_mask, other=0.0).to(tl.float32)
            a = (gate * tl.sigmoid(gate) * up).to(c_ptr.dtype.element_ty)
        else:
            a = tl.load(a_at, mask=a_mask, other=0.0)
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K)
        )
        acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip


def triton_linear(a, w, bias=None, *, silu_a=False, bm=64, bn=64, bk=64, warps=4, stages=3, out=None):
    m = a.shape[0]
    n, k = w.shape
    c = out if out is not None else torch.empty((m, n), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_kernel[grid](
        a, w, bias if bias is not None else w, c, m, n, k, a.stride(0), w.stride(0), c.stride(0),
        BM=bm, BN=bn, BK=bk, HAS_BIAS=bias is not None, SILU_A=silu_a, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


TILES = [
    (16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 4, 3),
    (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (32, 32, 256, 4, 3), (64, 32, 128, 4, 4), (128, 256, 64, 8, 3),
]  # fmt: skip


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000


def best_tile(k: int, run, reference: torch.Tensor) -> tuple[float, tuple | None, float]:
    """The fastest of TILES for run(tile) (us), its tile and its largest difference from reference."""
    best: tuple[float, tuple | None, float] = (float("inf"), None, float("nan"))
    for tile in TILES:
        if tile[2] > k:
            continue
        try:
            error = (run(tile).float() - reference).abs().max().item()
            us = graph_us(functools.partial(run, tile))
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit the shared memory
            print(f"  tile {tile}: {type(exc).__name__}", flush=True)
            continue
        if us < best[0]:
            best = (us, tile, error)
    return best


def time_shape(batch: int, name: str, k: int, n: int, has_bias: bool) -> dict:
    from trainer.rollout.builtin import kernels

    dev, dt = "cuda", torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
    w_kn = w.t().contiguous()
    bias = torch.randn(n, device=dev, dtype=dt) if has_bias else None
    x = torch.randn(batch, k, device=dev, dtype=dt)
    row = {"batch": batch, "shape": name, "K": k, "N": n}
    row["torch"] = graph_us(functools.partial(F.linear, x, w, bias))
    if bias is not None:
        row["torch-kn"] = graph_us(functools.partial(torch.addmm, bias, x, w_kn))
    else:
        row["torch-kn"] = graph_us(functools.partial(torch.mm, x, w_kn))

    def tiled(tile):
        bm, bn, bk, warps, stages = tile
        return triton_linear(x, w, bias, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages)

    row["triton"], row["triton_tile"], row["triton_max_err"] = best_tile(
        k, tiled, F.linear(x, w, bias).float()
    )
    if name == "down":  # the SiLU-and-multiply in the operand's load, against the engine's two kernels
        gate_up = torch.randn(batch, 2 * k, device=dev, dtype=dt)

        def two_kernels():
            return F.linear(kernels.silu_mul(gate_up), w)

        def fused(tile):
            bm, bn, bk, warps, stages = tile
            return triton_linear(gate_up, w, silu_a=True, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages)

        row["silu_mul+torch"] = graph_us(two_kernels)
        row["triton+silu"], row["triton+silu_tile"], row["triton+silu_max_err"] = best_tile(
            k, fused, two_kernels().float()
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="64,256,512")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = {  # name: (K, N, bias)
        "qkv": (HIDDEN, Q_OUT + 2 * KV_OUT, True),
        "o": (Q_OUT, HIDDEN, False),
        "gate_up": (HIDDEN, 2 * INTER, False),
        "down": (INTER, HIDDEN, False),
        "lm_head": (HIDDEN, VOCAB, False),
    }
    results = {"device": torch.cuda.get_device_name(), "rows": []}
    for batch in [int(b) for b in args.batches.split(",")]:
        for name, (k, n, has_bias) in shapes.items():
            row = time_shape(batch, name, k, n, has_bias)
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
