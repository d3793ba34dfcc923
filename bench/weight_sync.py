"""The host time of a colocated weight sync (the policy's FSDP2 parameters into the built-in engine), by
model depth (24 layers: the 0.5B's 290 tensors): a one-rank `PolicyRank` built from verl keys, its
`sync_weights()` timed in batches.

On a GPU the sync of a 0.5B model took 60 ms of a one-H200 step with the GPU busy 3.6 ms of it: its
cost is host work per tensor, which a narrow model of the same depth (24 layers: 290 tensors) shows
on a CPU too.

    python bench/weight_sync.py [--layers 24] [--hidden 64] [--device cpu] [--samples 5] [--calls 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testing.tiny import make_tiny_model
from trainer.config import load_config
from trainer.model import default_precision
from trainer.parallel.distributed import local_data_parallel
from trainer.parallel.ranks import PolicyRank
from trainer.parallel.settings import policy_rank_settings


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="syncs a sample")
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(folder, layers=args.layers, hidden=args.hidden)
        keys = [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=builtin"]
        settings = policy_rank_settings(load_config(keys, check=False), default_precision(device), steps=1)
        rank = PolicyRank(settings, local_data_parallel(device), device)
        try:
            for _ in range(3):  # warm-up
                rank.sync_weights()
            samples = []
            for _ in range(args.samples):
                start = time.perf_counter()
                for _ in range(args.calls):
                    rank.sync_weights()
                samples.append((time.perf_counter() - start) / args.calls * 1e3)
        finally:
            rank.close()
    median = sorted(samples)[len(samples) // 2]
    listed = " ".join(f"{sample:.1f}" for sample in samples)
    print(f"{args.layers} layers x {args.hidden} on {device}: ms a sync {listed}, median {median:.1f}")


if __name__ == "__main__":
    main()
