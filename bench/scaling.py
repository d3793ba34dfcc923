"""Weak scaling of the distributed trainer: the same GRPO step per GPU on 1, 2, 4, ... GPUs of one host.

    python bench/scaling.py --gpus 1,2 [--steps 4] [--prompts-per-gpu 64] [--n 8] [--response-length 256]
    python bench/scaling.py --gpus 1,2,4 --model-size 1.5b          # Qwen2.5-1.5B's shape
    python bench/scaling.py --gpus 2 --small --device cpu            # CPU smoke run (gloo, tiny model)

For each GPU count W it runs `python -m trainer.main_ppo` on a randomly initialised model of
Qwen2.5-0.5B's shape (Qwen tokenizer), GSM8K train prompts, W x 64 prompts x n=8 responses of 256
tokens per step (a random model never stops early), GRPO with a KL loss against a reference model,
one optimizer step per batch, rewards in-process: Ray ranks with FSDP2 (bf16 compute, fp32 master
weights), packed micro-batches, the built-in engine colocated on every GPU. Then it prints, averaged
over the steps after the first (warm-up):

    timing_s/* (gen, ref, update_actor, update_weights, step), perf/throughput (tokens/s/GPU),
    perf/mfu/actor, perf/max_memory_allocated_gb, and the weak-scaling efficiency
    throughput(W) / throughput(1) (tokens/s per GPU; 1.0 is perfect).

Extra `key=value` arguments go to every run (e.g. actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16).
On the offline GPU machines: `bash bench/gpu_prepare.sh` here first (wheels incl. a slimmed Ray, and
GSM8K, in .gpu/), then one device call; its header has the command line.
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
sys.path.insert(0, str(ROOT / "bench"))

REPORTED = (
    "timing_s/gen",
    "timing_s/ref",
    "timing_s/old_log_prob",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "perf/throughput",
    "perf/mfu/actor",
    "perf/max_memory_allocated_gb",
    "response_length/mean",
)


def qwen25_15b_config():
    """Qwen2.5-1.5B's shape (1.54B parameters with tied embeddings)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    )


def prepare(out: Path, gsm8k: Path, model_size: str, small: bool) -> tuple[Path, Path]:
    from services.data_server.export import write_verl_parquet
    from services.data_server.sources import gsm8k_row, read_records
    from testing.tiny import make_tiny_model, qwen25_05b_config

    model = out / f"model-{'small' if small else model_size}"
    if not (model / "config.json").exists():
        config = None if small else {"0.5b": qwen25_05b_config, "1.5b": qwen25_15b_config}[model_size]()
        make_tiny_model(model, config=config, tokenizer="qwen", hidden=64, layers=2)
    data = out / "data"
    if not (data / "train.parquet").exists():
        rows = read_records(gsm8k / "train.jsonl")
        write_verl_parquet(
            [gsm8k_row(r["question"], r["answer"], "train", i) for i, r in enumerate(rows)],
            data / "train.parquet",
        )
    return model, data


def run_command(args, world: int, model: Path, data: Path, run_dir: Path, extra: list[str]) -> list[str]:
    prompts = args.prompts_per_gpu * world
    return [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'train.parquet'}",
        f"data.train_batch_size={prompts}",
        "data.max_prompt_length=512",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",  # one optimizer step: on-policy
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch * 2}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro_batch * 2}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.rollout.n={args.n}",
        "reward_model.mode=local",
        f"trainer.n_gpus_per_node={world}",
        f"trainer.device={args.device}",
        "trainer.use_ray=true",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        f"trainer.log_dir={run_dir}",
        f"trainer.default_local_dir={run_dir / 'ckpt'}",
        "trainer.resume_mode=disable",
        *extra,
    ]


def summarise(run_dir: Path) -> dict[str, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "timing_s/step" in m]
    measured = steps[1:] or steps
    return {
        key: statistics.mean(m[key] for m in measured) for key in REPORTED if all(key in m for m in measured)
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", default="1,2", help="comma-separated GPU counts, in one host")
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_scaling")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-gpu", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=32, help="sequences per update forward, per GPU")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--model-size", choices=("0.5b", "1.5b"), default="0.5b")
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument("--device", default="auto")
    args, extra = parser.parse_known_args()
    model, data = prepare(args.out, args.gsm8k, args.model_size, args.small)
    results: dict[int, dict[str, float]] = {}
    for world in (int(w) for w in args.gpus.split(",")):
        run_dir = args.out / f"run-{world}gpu"
        done = subprocess.run(run_command(args, world, model, data, run_dir, extra), cwd=ROOT, check=False)
        if done.returncode == 0:
            results[world] = summarise(run_dir)
        else:
            print(f"the {world}-GPU run failed (exit {done.returncode}); see its output above", flush=True)
    if results:
        print_table(args, results)


def print_table(args, results: dict[int, dict[str, float]]) -> None:
    worlds = sorted(results)
    print(
        f"\nweak scaling: {args.prompts_per_gpu} prompts x n={args.n} per GPU, responses <= "
        f"{args.response_length} tokens; mean over steps 2..{args.steps}"
    )
    print(f"  {'metric':<32}" + "".join(f"{f'{w} GPU':>12}" for w in worlds))
    for key in REPORTED:
        if any(key in results[w] for w in worlds):
            cells = "".join(f"{results[w].get(key, float('nan')):12.3f}" for w in worlds)
            print(f"  {key:<32}{cells}")
    base = results[worlds[0]].get("perf/throughput")
    if base:
        cells = "".join(f"{results[w]['perf/throughput'] / base:12.3f}" for w in worlds)
        print(f"  {'weak-scaling efficiency':<32}{cells}   (throughput per GPU vs {worlds[0]} GPU)")


if __name__ == "__main__":
    main()
