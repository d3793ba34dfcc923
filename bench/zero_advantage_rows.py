"""What skipping the rows without signal saves in a policy update (actor.skip_zero_advantage_rows).

    python bench/zero_advantage_rows.py [--rows 64] [--repeats 3] [--device cpu|cuda]

One process, a small random Qwen2 (hidden 256, 4 layers; --hidden/--layers), GRPO groups of 8 rows of
~96 prompt and ~160 response tokens, a loss of the policy term alone (no KL, no entropy). For each share of
groups whose rewards were all equal (their advantages all 0), `Policy.update` with the skip off and on,
from the same weights: seconds (the median of --repeats and the range), and the largest difference of the
two updates' parameters (the skip trains the same update from fewer rows).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testing.tiny import make_tiny_model  # noqa: E402
from trainer.batch import TrainBatch  # noqa: E402
from trainer.model import load_policy  # noqa: E402
from trainer.rollout.base import Rollout  # noqa: E402
from trainer.workers.common import OptimizerSettings, UpdateSettings  # noqa: E402
from trainer.workers.policy import Policy, PolicyLossSettings  # noqa: E402

GROUP = 8


def make_batch(rows: int, no_signal_share: float, seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for row in range(rows):
        prompt, response = (
            int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((64, 128), (96, 224))
        )
        rollouts.append(
            Rollout(
                prompt_ids=torch.randint(3, 100, (prompt,), generator=gen).tolist(),
                response_ids=torch.randint(3, 100, (response,), generator=gen).tolist(),
                logprobs=[0.0] * response,
                loss_mask=[1] * response,
                finish_reason="length",
                prompt_index=row // GROUP,
            )
        )
    batch = TrainBatch.from_rollouts(rollouts, pad_id=0)
    advantages = torch.randn(rows, 1, generator=gen).expand_as(batch.response_mask) * batch.response_mask
    groups = rows // GROUP
    quiet = torch.randperm(groups, generator=gen)[: round(no_signal_share * groups)]
    for group in quiet.tolist():
        advantages[group * GROUP : (group + 1) * GROUP] = 0.0
    return batch.with_fields(advantages=advantages.contiguous())


def policy(model, rows: int, micro: int, skip: bool) -> Policy:
    optim = OptimizerSettings(
        lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999), grad_clip=1.0, warmup_steps=0, total_steps=10,
        schedule="constant", min_lr_ratio=0.0,
    )  # fmt: skip
    loss = PolicyLossSettings(
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean",
        entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
        skip_zero_advantage_rows=skip,
    )  # fmt: skip
    return Policy(model, optim, UpdateSettings(mini_batch_size=rows, micro_batch_size=micro), loss)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shares", default="0,0.25,0.5,0.75")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    path = make_tiny_model(
        Path(tempfile.mkdtemp()) / "m", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2, seed=0
    )
    base = load_policy(str(path)).to(device)
    print(
        f"{args.rows} rows in groups of {GROUP}, micro-batches of {args.micro}, {device}, {torch.__version__}"
    )
    print("| groups without signal | update s, skip off | skip on | on / off | max parameter difference |")
    print("|---|---|---|---|---|")
    for share in (float(s) for s in args.shares.split(",")):
        batch = make_batch(args.rows, share)
        seconds, params = {}, {}
        for repeat in range(args.repeats):
            for skip in (False, True) if repeat % 2 == 0 else (True, False):
                worker = policy(copy.deepcopy(base), args.rows, args.micro, skip)
                start = time.perf_counter()
                worker.update(batch)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds.setdefault(skip, []).append(time.perf_counter() - start)
                params[skip] = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
        off, on = (statistics.median(seconds[skip]) for skip in (False, True))
        spread = {skip: f"{min(seconds[skip]):.2f}-{max(seconds[skip]):.2f}" for skip in (False, True)}
        difference = float((params[True] - params[False]).abs().max())
        print(
            f"| {share:.0%} | {off:.2f} ({spread[False]}) | {on:.2f} ({spread[True]}) | {on / off:.2f} | "
            f"{difference:.1e} |"
        )


if __name__ == "__main__":
    main()
