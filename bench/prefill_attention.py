"""What a causal SDPA call costs the host at a shape it has not seen, by backend (CUDA).

The built-in engine's prefill runs SDPA over right-padded prompts [B, heads, T, D], and B and T change
from one rollout phase to the next. cuDNN's attention, SDPA's first choice on Hopper in recent torch,
builds an execution plan on the host per shape; flash attention has no per-shape setup. For each backend
set this times the first call at each of --shapes new shapes (host wall time to the call's return, then
to the GPU's end) and a repeat call at the last one, forward only and (--backward) forward + backward.

    python bench/prefill_attention.py [--heads 14 --head-dim 64] [--shapes 6] [--backward]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CHOICES = {
    "default": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "engine": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def timed_call(q, k, v, backward: bool) -> tuple[float, float]:
    """(ms until the call returns on the host, ms until the GPU is done) of one causal SDPA call."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if backward:
        out.sum().backward()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", type=int, default=14)  # Qwen2.5-0.5B
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--shapes", type=int, default=6)
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, backward={args.backward}")
    print(f"{'backends':<10}{'B x T':>12}{'host ms':>10}{'done ms':>10}")
    for offset, (name, backends) in enumerate(CHOICES.items()):
        first = 160 + offset * 64  # each backend set at widths no set before it ran
        widths = [first + 8 * i for i in range(args.shapes)]
        for i, width in enumerate([*widths, widths[-1]]):
            batch = 64
            q, k, v = (
                torch.randn(
                    batch, args.heads, width, args.head_dim, device="cuda", dtype=torch.bfloat16
                ).requires_grad_(args.backward)
                for _ in range(3)
            )
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                host, done = timed_call(q, k, v, args.backward)
            repeat = i == len(widths)
            label = f"{batch} x {width}" + (" again" if repeat else "")
            print(f"{name:<10}{label:>12}{host:>10.1f}{done:>10.1f}")


if __name__ == "__main__":
    main()
