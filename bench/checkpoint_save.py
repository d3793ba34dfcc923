"""What verl's checkpoint.save_contents buys: one role's checkpoint with AdamW ("model", "optimizer",
"extra", verl's default) against the weights alone ("model"), SmolLM2-135M's shape (random weights, one
AdamW step taken so the moments exist), each saved --repeats times in this process on the CPU.

    python bench/checkpoint_save.py [--repeats 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.checkpoint import LocalRole, TrainState, save_checkpoint

SMOLLM2_135M = LlamaConfig(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
)
CASES = {"model, optimizer, extra": ["model", "optimizer", "extra"], "model": ["model"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default="/tmp", help="where the checkpoints are written (then removed)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMOLLM2_135M)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ids = torch.randint(0, SMOLLM2_135M.vocab_size, (1, 16))
    model(ids, labels=ids).loss.backward()
    optimizer.step(), scheduler.step()
    role = LocalRole(model, optimizer, scheduler)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    sizes = {}
    try:
        for repeat in range(args.repeats):
            for name, contents in CASES.items():  # alternating, so a slow moment hits both
                start = time.perf_counter()
                path = save_checkpoint(
                    root / f"{repeat}-{len(contents)}",
                    1,
                    roles={"actor": role},
                    state=TrainState(step=1),
                    keep_last=None,
                    contents={"actor": contents},
                )
                seconds[name].append(time.perf_counter() - start)
                sizes[name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{params:.1f}M parameters (fp32), {args.repeats} saves each")
    for name in CASES:
        runs = ", ".join(f"{s:.2f}" for s in seconds[name])
        print(
            f"  save_contents=[{name}]: median {statistics.median(seconds[name]):.2f} s ({runs}), "
            f"{sizes[name] / 1e6:.0f} MB"
        )


if __name__ == "__main__":
    main()
